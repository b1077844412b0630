// The raw-output reader and the Markdown writer of dmuon-bench-report (document.hpp).
#include "document.hpp"

#include <cstdarg>
#include <cstdio>
#include <filesystem>

#include "dmuon/atomic_file.hpp"
#include "dmuon/sim.hpp"

namespace dmuon::bench_report {

const std::vector<std::string>& compared_optimizer_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (sim::ComparedOptimizer o : sim::compared_optimizers()) out.push_back(sim::to_string(o));
    return out;
  }();
  return names;
}

std::string fmt(const char* format, ...) {
  va_list args, copy;
  va_start(args, format);
  va_copy(copy, args);
  std::string s(std::vsnprintf(nullptr, 0, format, copy), '\0');
  va_end(copy);
  std::vsnprintf(s.data(), s.size() + 1, format, args);
  va_end(args);
  return s;
}

std::string ms(double seconds) { return fmt("%.1f", 1e3 * seconds); }
std::string pct(double fraction) { return fmt("%+.0f%%", 100 * fraction); }

std::string join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? separator : "") + parts[i];
  return s;
}

std::string trim(const std::string& s) {
  const auto space = " \t\r\n";
  const auto begin = s.find_first_not_of(space);
  return begin == std::string::npos ? "" : s.substr(begin, s.find_last_not_of(space) - begin + 1);
}

std::map<std::string, Value> by_optimizer(const Value& run) {
  std::map<std::string, Value> rows;
  for (const auto& r : run["results"].list()) rows.emplace(r["optimizer"].str(), r);
  return rows;
}

Value result(const Value& run, const std::string& optimizer) {
  const auto rows = by_optimizer(run);
  const auto it = rows.find(optimizer);
  DMUON_CHECK(it != rows.end(), run.file(), ": no result for optimizer '", optimizer, "' in 'results'");
  return it->second;
}

double simulated(const Value& row, const std::string& optimizer, const char* key) { return row[optimizer][key].num(); }

Inputs::Inputs(std::string dir) : dir_(std::move(dir)) {
  DMUON_CHECK(std::filesystem::is_directory(dir_), "--dir ", dir_, ": no such folder");
}

std::optional<Value> Inputs::json(const std::string& name) const {
  if (!std::filesystem::exists(path(name))) return std::nullopt;
  const std::string text = read_file(path(name));
  const auto begin = text.find('{'), end = text.rfind('}');
  if (begin == std::string::npos) return std::nullopt;
  const auto length = end < begin ? 0 : end - begin + 1;  // end is npos (huge) when there is no '}'
  try {
    return Value(std::make_shared<const nlohmann::json>(nlohmann::json::parse(text.substr(begin, length))),
                 path(name));
  } catch (const nlohmann::json::parse_error& e) {
    DMUON_FAIL(path(name), ": not valid JSON: ", e.what());
  }
}

std::string Inputs::text_or(const std::string& name, const std::string& fallback) const {
  return std::filesystem::exists(path(name)) ? trim(read_file(path(name))) : fallback;
}

void command_line(Report& r, const Inputs& in, const std::string& name) {
  r.p(std::string("`") + in.command(name) + "`");
  r.p();
}

void not_run(Report& r, const Inputs& in, const std::string& name) {
  r.p("*Not run: " + in.path(name) + " is missing or holds no JSON (a run cut short).*");
  r.p();
}

void results_table(Report& r, const Inputs& in, const Value& run, const std::string& title, const std::string& name,
                   const std::vector<Column<Value>>& columns) {
  r.p(fmt("### %s: %lld BLAS thread(s) per rank", title.c_str(), run["threads_per_rank"].integer()) +
      (run["oversubscribed"].flag() ? " — **OVERSUBSCRIBED** (more ranks than cores: not comparable with np 1-2)"
                                    : ""));
  r.p();
  command_line(r, in, name);
  const auto rows = by_optimizer(run);
  const auto adamw = rows.find("adamw");
  std::vector<Column<Value>> all = {{"optimizer", [](const Value& v) { return v["optimizer"].str(); }},
                                    {"step ms", [](const Value& v) { return ms(v["step_s_median"].num()); }}};
  all.insert(all.end(), columns.begin(), columns.end());
  all.push_back({"vs AdamW", [&](const Value& v) {
                   if (adamw == rows.end()) return std::string();
                   return fmt("%.3fx", v["step_s_median"].num() / adamw->second["step_s_median"].num());
                 }});
  all.push_back({"DMuon speedup", [](const Value& v) {
                   return v.has("dmuon_speedup") ? fmt("%.2fx", v["dmuon_speedup"].num()) : std::string();
                 }});
  std::vector<Value> ordered;
  for (const auto& o : compared_optimizer_names())
    if (rows.count(o)) ordered.push_back(rows.at(o));
  table(r, all, ordered);
}

}  // namespace dmuon::bench_report
