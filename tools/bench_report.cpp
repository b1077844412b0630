// dmuon bench report: docs/BENCHMARKS.md from what `make bench` (scripts/bench.sh) leaves in docs/bench/:
// <name>.json, the output of one benchmark command; <name>.cmd, that command's line; date.txt.
// A benchmark whose file is missing or holds no JSON (a run cut short) gets a note in place of its section, so a
// partial run still gives a report; a malformed file, a missing key or a wrong type is an error naming the file
// and the key.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cli.hpp"
#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "io/json_file.hpp"
#include "optim_bench.hpp"

namespace dmuon::cli {

namespace {

// Simulated figures within this relative error of the measured ones count as matching.
constexpr double kSimTolerance = 0.25;

__attribute__((format(printf, 1, 2))) std::string fmt(const char* format, ...) {
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

// One value in an input file, with its file and its key path ("results[1].step_s_median") for errors.
class Value {
 public:
  Value(std::shared_ptr<const nlohmann::json> root, std::string file)
      : root_(std::move(root)), j_(root_.get()), file_(std::move(file)) {}

  const std::string& file() const { return file_; }
  bool has(const std::string& key) const { return j_->is_object() && j_->contains(key); }
  Value operator[](const std::string& key) const {
    DMUON_CHECK(has(key), file_, ": missing key '", child_key(key), "'");
    return child(j_->at(key), child_key(key));
  }
  std::vector<Value> list() const {
    expect(j_->is_array(), "a list");
    std::vector<Value> items;
    for (size_t i = 0; i < j_->size(); ++i) items.push_back(child((*j_)[i], key_ + "[" + std::to_string(i) + "]"));
    return items;
  }
  double num() const {
    expect(j_->is_number(), "a number");
    return j_->get<double>();
  }
  long long integer() const {
    expect(j_->is_number_integer(), "an integer");
    return j_->get<long long>();
  }
  std::string str() const {
    expect(j_->is_string(), "a string");
    return j_->get<std::string>();
  }
  bool flag() const {
    expect(j_->is_boolean(), "true or false");
    return j_->get<bool>();
  }

 private:
  Value child(const nlohmann::json& j, std::string key) const {
    Value v = *this;
    v.j_ = &j;
    v.key_ = std::move(key);
    return v;
  }
  std::string child_key(const std::string& key) const { return key_.empty() ? key : key_ + "." + key; }
  void expect(bool ok, const char* what) const {
    DMUON_CHECK(ok, file_, ": '", key_, "' must be ", what, ", got ", j_->type_name());
  }

  std::shared_ptr<const nlohmann::json> root_;  // keeps j_ alive
  const nlohmann::json* j_;
  std::string file_, key_;
};

// A benchmark run's result rows by optimizer name.
std::map<std::string, Value> by_optimizer(const Value& run) {
  std::map<std::string, Value> rows;
  for (const auto& r : run["results"].list()) rows.emplace(r["optimizer"].str(), r);
  return rows;
}

// The result row of `optimizer` in a benchmark run.
Value result(const Value& run, const std::string& optimizer) {
  const auto rows = by_optimizer(run);
  const auto it = rows.find(optimizer);
  DMUON_CHECK(it != rows.end(), run.file(), ": no result for optimizer '", optimizer, "' in 'results'");
  return it->second;
}

// The folder of raw benchmark output.
class Inputs {
 public:
  explicit Inputs(std::string dir) : dir_(std::move(dir)) {
    DMUON_CHECK(std::filesystem::is_directory(dir_), "--dir ", dir_, ": no such folder");
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // The JSON object in `name` (commands may print lines around it); nullopt when the file is missing or holds
  // no object (a run cut short).
  std::optional<Value> json(const std::string& name) const {
    if (!std::filesystem::exists(path(name))) return std::nullopt;
    const std::string text = read_file(path(name));
    const auto begin = text.find('{'), end = text.rfind('}');
    if (begin == std::string::npos) return std::nullopt;
    const auto length = end < begin ? 0 : end - begin + 1;  // end is npos (huge) when there is no '}'
    return Value(std::make_shared<const nlohmann::json>(parse_json(text.substr(begin, length), path(name))),
                 path(name));
  }
  // The command line bench.sh recorded for output `name`.
  std::string command(const std::string& name) const { return text_or(name + ".cmd", "(not run)"); }
  std::string date() const { return text_or("date.txt", "?"); }

 private:
  std::string text_or(const std::string& name, const std::string& fallback) const {
    return std::filesystem::exists(path(name)) ? trim(read_file(path(name))) : fallback;
  }
  std::string dir_;
};

// The document being written, and its headline figures (placed after the introduction at the end).
struct Report {
  std::vector<std::string> lines;
  std::vector<std::string> headline;
  void p(const std::string& line = "") { lines.push_back(line); }
};

template <typename Row>
struct Column {
  std::string header;
  std::function<std::string(const Row&)> cell;
};

// A Markdown table and the blank line after it.
template <typename Row>
void table(Report& r, const std::vector<Column<Row>>& columns, const std::vector<Row>& rows) {
  std::vector<std::string> cells;
  std::string rule = "|";
  for (const auto& c : columns) {
    cells.push_back(c.header);
    rule += "---|";
  }
  r.p("| " + join(cells, " | ") + " |");
  r.p(rule);
  for (const auto& row : rows) {
    cells.clear();
    for (const auto& c : columns) cells.push_back(c.cell(row));
    r.p("| " + join(cells, " | ") + " |");
  }
  r.p();
}

void command_line(Report& r, const Inputs& in, const std::string& name) {
  r.p("`" + in.command(name) + "`");
  r.p();
}

// In place of a section whose input is missing.
void not_run(Report& r, const Inputs& in, const std::string& name) {
  r.p("*Not run: " + in.path(name) + " is missing or holds no JSON (a run cut short).*");
  r.p();
}

// A benchmark run's heading, command line and results table: the optimizer, its step, `columns`, its step over
// AdamW's and DMuon's speedup over it.
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
  for (const auto& o : optim_bench::optimizer_names())
    if (rows.count(o)) ordered.push_back(rows.at(o));
  table(r, all, ordered);
}

void introduction(Report& r, const Inputs& in, const std::optional<Value>& first_optimizer_run) {
  r.p("# Benchmarks: the paper's evaluation on this machine");
  r.p();
  r.p("Generated by `make bench` (scripts/bench.sh, then `dmuon bench report`) — do not edit by hand.");
  if (first_optimizer_run) {
    const Value& o = *first_optimizer_run;
    r.p(fmt("Machine: **%s**, %lld cores, %s. Date: %s. ", o["cpu"].str().c_str(), o["cores"].integer(),
            o["blas"].str().c_str(), in.date().c_str()) +
        "The machine is shared with other jobs, so every table compares variants measured side by side in one "
        "run (one process per rank, variants interleaved step by step), never figures from different runs.");
  }
  r.p();
  r.p("Definitions (tools/optim_bench.hpp, include/dmuon/comm.hpp):");
  r.p("- **step**: one `optimizer.step()` after the gradients were reduced; per step the slowest rank counts; "
      "the median over the timed steps (one untimed warm-up step first; for an even count of steps the mean of "
      "the two middle ones, include/dmuon/statistics.hpp). The variants of one table run "
      "interleaved — all alive at once, step s of each in turn — so load changes reach them alike.");
  r.p("- **sent MB/rank**: bytes each rank sends in the optimizer step, computed exactly from the sizes of the "
      "collectives it issues, as a ring / pipelined chain sends them ((n-1)/n of an all-gather's or "
      "reduce-scatter's buffer, 2(n-1)/n of an all-reduce's): the nccl-tests bus convention, counted by "
      "`comm::counting`. What OpenMPI's chosen algorithm puts on the wire may differ.");
  r.p("- **exposed ms**: time the rank spent inside the communicator (posting, and polling until completion) "
      "during the step: communication not hidden behind compute.");
  r.p("- **muon-gather-plain**: the paper's baseline, gather-then-compute (DESIGN 3.2) with the plain standard "
      "recurrence (`NsOptions{algo=standard, symmetric=false}`), one matrix per NS call, no tuning. "
      "**muon-gather**: the same with our tuned NS engine (isolates owner execution). **dmuon**: owner-aligned "
      "layout, MILP owners (rank 0 solves with CBC and broadcasts), tuned NS per shape.");
  r.p("- Threads: one BLAS thread per rank when ranks >= cores, else cores/ranks; NS configurations are tuned per "
      "shape (batch 1) with that thread count by `dmuon tune`'s autotuner and cached.");
  r.p();
}

using OptimizerRuns = std::map<int, std::optional<Value>>;  // by rank count

// DMuon's Newton-Schulz time per rank: the plan's prediction (tune cache times) against the time measured inside
// the step (Optimizer::last_stats), when the run reports both.
void per_rank_ns(Report& r, const Value& dmuon, bool oversubscribed) {
  if (!dmuon.has("ns_s_per_rank") || !dmuon.has("predicted_ns_s_per_rank")) return;
  const auto measured = dmuon["ns_s_per_rank"].list(), predicted = dmuon["predicted_ns_s_per_rank"].list();
  std::vector<std::string> cells;
  for (size_t i = 0; i < measured.size() && i < predicted.size(); ++i)
    cells.push_back(fmt("rank %zu %s / %s ms (%s)", i, ms(predicted[i].num()).c_str(), ms(measured[i].num()).c_str(),
                        pct(predicted[i].num() / measured[i].num() - 1).c_str()));
  r.p("DMuon's Newton-Schulz per rank, predicted by the plan from the tune cache / measured in the step: " +
      join(cells, ", ") + "." +
      (oversubscribed ? " The tune cache times one rank on a core of its own; here ranks share cores." : ""));
  r.p();
}

// Section 1: the optimizer step at each rank count.
void optimizer_section(Report& r, const Inputs& in, const OptimizerRuns& runs) {
  r.p("## 1. Optimizer step (Qwen2.5-0.5B shapes, first 4 layers)");
  r.p();
  const std::vector<Column<Value>> columns = {
      {"sent MB/rank", [](const Value& v) { return fmt("%.1f", v["sent_bytes_per_rank"].num() / 1e6); }},
      {"exposed ms", [](const Value& v) { return ms(v["exposed_comm_s"].num()); }},
      {"weight norm", [](const Value& v) { return fmt("%.6g", v["weight_norm"].num()); }}};
  for (const auto& [np, run] : runs) {
    const std::string name = fmt("optimizer-np%d.json", np);
    if (!run) {
      r.p(fmt("### np %d", np));
      r.p();
      not_run(r, in, name);
      continue;
    }
    results_table(r, in, *run, fmt("np %d", np), name, columns);
    const Value plan = (*run)["plan"];
    const std::string overhead =
        run->has("dmuon_overhead_vs_adamw")
            ? " DMuon's overhead over AdamW: " + pct((*run)["dmuon_overhead_vs_adamw"].num()) + "."
            : "";
    r.p(fmt("Plan: %s%s, predicted NS makespan %s ms (round-robin: %s ms). ", plan["balancer"].str().c_str(),
            plan["fell_back"].flag() ? " (fell back to LPT)" : "", ms(plan["predicted_makespan_s"].num()).c_str(),
            ms(plan["rr_predicted_makespan_s"].num()).c_str()) +
        fmt("Muon variants' weight norms agree within %.1e (same math).", (*run)["muon_weight_norm_rel_spread"].num()) +
        overhead);
    r.p();
    per_rank_ns(r, result(*run, "dmuon"), (*run)["oversubscribed"].flag());
  }
  if (runs.count(2) && runs.at(2)) {
    const Value& o = *runs.at(2);
    r.headline.push_back(
        fmt("Optimizer step, Qwen2.5-0.5B (4 layers), np 2: DMuon %s ms, %.2fx faster than muon-gather-plain (paper "
            "baseline) and %.2fx faster than muon-gather (same NS engine).",
            ms(result(o, "dmuon")["step_s_median"].num()).c_str(),
            result(o, "muon-gather-plain")["dmuon_speedup"].num(), result(o, "muon-gather")["dmuon_speedup"].num()));
  }
}

// Section 2: DMuon with each part removed.
void ablation_section(Report& r, const Inputs& in) {
  const std::string name = "ablation-np2.json";
  const auto ablation = in.json(name);
  if (!ablation) {
    r.p("## 2. Ablation (np 2)");
    r.p();
    not_run(r, in, name);
    return;
  }
  const Value& ab = *ablation;
  r.p("## 2. Ablation (np 2, " + ab["model"].str() + ")");
  r.p();
  command_line(r, in, name);
  r.p("Each variant runs interleaved with DMuon itself; slowdown = its step / DMuon's step in that pair. "
      "At one BLAS thread per rank batching is a loop over the same calls, so the no-batching row is a noise "
      "control.");
  r.p();
  r.p(fmt("DMuon %s ms (median over the pairs); muon-gather-plain %s ms (%.2fx). ",
          ms(ab["dmuon_step_s"].num()).c_str(), ms(ab["muon_gather_plain_step_s"].num()).c_str(),
          ab["muon_gather_plain_slowdown"].num()) +
      "Share definition (log-time attribution): `" + ab["share_definition"].str() +
      "` — a part whose removal does not slow the step gets 0.");
  r.p();
  const auto share = [](const char* key) { return [key](const Value& v) { return fmt("%.0f%%", v[key].num()); }; };
  table<Value>(r,
               {{"part removed", [](const Value& v) { return v["removed"].str(); }},
                {"variant", [](const Value& v) { return v["variant"].str(); }},
                {"step ms", [](const Value& v) { return ms(v["step_s"].num()); }},
                {"slowdown", [](const Value& v) { return fmt("%.2fx", v["slowdown"].num()); }},
                {"share", share("share_pct")}},
               ab["parts"].list());
  const auto groups = ab["groups"].list();
  std::vector<std::string> shares;
  for (const auto& g : groups)
    shares.push_back(
        fmt("%s %.0f%% (paper %.0f%%)", g["group"].str().c_str(), g["share_pct"].num(), g["paper_share_pct"].num()));
  r.headline.push_back("Ablation, np 2 (shares of DMuon's speedup, log-time attribution): " + join(shares, "; ") + ".");
  table<Value>(r,
               {{"paper group", [](const Value& v) { return v["group"].str(); }},
                {"ours", share("share_pct")},
                {"paper", share("paper_share_pct")}},
               groups);
}

// Section 3's last part: DMuon's overhead over AdamW on the demo model at np 2 against the tokens per step.
void batch_sweep(Report& r, const Inputs& in) {
  r.p("### DMuon's overhead against tokens per step (demo, np 2)");
  r.p();
  r.p("Newton-Schulz costs each owner the same time per optimizer step whatever the batch, while forward and "
      "backward grow with the tokens per step, so DMuon's overhead over AdamW falls as the batch grows (the "
      "paper's +2% is measured at LLM batch sizes). Each row is one `bench e2e --config demo --batch B` run at "
      "np 2, AdamW and DMuon interleaved:");
  r.p();
  std::vector<std::string> files;
  std::vector<Value> runs;
  for (const char* name : {"e2e-demo-np2-b16.json", "e2e-demo-np2.json", "e2e-demo-np2-b128.json",
                           "e2e-demo-np2-b256.json"})
    if (auto run = in.json(name)) {
      files.push_back(name);
      runs.push_back(*run);
    } else {
      r.p(fmt("- *Not run: %s.*", in.path(name).c_str()));
    }
  const auto step = [](const char* optimizer, const char* key) {
    return [=](const Value& v) { return ms(result(v, optimizer)[key].num()); };
  };
  table<Value>(r,
               {{"sequences per step", [](const Value& v) { return fmt("%lld", v["batch"].integer()); }},
                {"tokens per step", [](const Value& v) { return fmt("%lld", v["tokens_per_step"].integer()); }},
                {"adamw step ms", step("adamw", "step_s_median")},
                {"dmuon step ms", step("dmuon", "step_s_median")},
                {"dmuon optimizer ms", step("dmuon", "optimizer_s")},
                {"DMuon vs AdamW", [](const Value& v) { return fmt("%+.1f%%", 100 * v["dmuon_overhead_vs_adamw"].num()); }}},
               runs);
  for (const auto& f : files) r.p("- `" + in.command(f) + "`");
  r.p();
  if (runs.empty()) return;
  std::vector<std::string> figures;
  for (const auto& v : runs)
    figures.push_back(fmt("%+.1f%% at %lld", 100 * v["dmuon_overhead_vs_adamw"].num(), v["tokens_per_step"].integer()));
  r.headline.push_back("End to end, GPT demo, np 2, DMuon's overhead over AdamW by tokens per step: " +
                       join(figures, ", ") + " (paper +2%).");
}

// Section 3: training steps of the GPT example.
void e2e_section(Report& r, const Inputs& in) {
  r.p("## 3. End to end (GPT example, `dmuon bench e2e`)");
  r.p();
  r.p("The Trainer of `dmuon train` (include/dmuon/trainer.hpp): forward and backward through the sharded hooks "
      "(Z3), then the optimizer step; per step the slowest rank, median of the timed steps after 2 warm-up steps; "
      "the trainers are alive at once and stepped in turn. "
      "muon-gather-plain is the Trainer's gather-then-compute optimizer with the plain NS recurrence "
      "(TrainOptions::ns); dmuon uses the Trainer's own owner plan and NS options. `demo` is make demo's model and "
      "batch (L4 C128 NH4 T64, B64: 4,096 tokens per step); `large` is L6 C256 NH4 T128, B16.");
  r.p();
  const std::vector<Column<Value>> columns = {
      {"fwd+bwd ms", [](const Value& v) { return ms(v["fwd_bwd_s"].num()); }},
      {"optimizer ms", [](const Value& v) { return ms(v["optimizer_s"].num()); }},
      {"comm wait ms", [](const Value& v) { return ms(v["comm_wait_s"].num()); }}};
  const std::vector<std::pair<std::string, std::vector<int>>> configs = {{"demo", {1, 2, 4}}, {"large", {1, 2}}};
  for (const auto& [config, nps] : configs) {
    for (int np : nps) {
      const std::string title = fmt("%s, np %d", config.c_str(), np);
      const std::string name = fmt("e2e-%s-np%d.json", config.c_str(), np);
      const auto run = in.json(name);
      if (!run) {
        r.p("### " + title);
        r.p();
        not_run(r, in, name);
        continue;
      }
      results_table(r, in, *run, title, name, columns);
      if (!run->has("dmuon_overhead_vs_adamw")) continue;
      const double overhead = (*run)["dmuon_overhead_vs_adamw"].num();
      if (config == "demo" && np == 2)
        r.headline.push_back(
            fmt("End to end, GPT demo, np 2: DMuon %+.1f%% step time over AdamW, %.2fx faster than "
                "muon-gather-plain.",
                100 * overhead, result(*run, "muon-gather-plain")["dmuon_speedup"].num()));
      r.p(fmt("DMuon's end-to-end overhead over AdamW: %+.1f%%.", 100 * overhead));
      r.p();
    }
  }
  batch_sweep(r, in);
}

// An optimizer's figure `key` ("step_s", "optimizer_s", ...) in one row of `dmuon simulate --json`.
double simulated(const Value& row, const std::string& optimizer, const char* key) { return row[optimizer][key].num(); }

// One simulated figure against its measurement: an optimizer's step, or the ratio of two.
struct SimCheck {
  int np;
  std::string what;
  double measured, simulated;
  bool oversubscribed;
  double error() const { return simulated / measured - 1; }
};

size_t count_within(const std::vector<SimCheck>& checks) {
  return std::count_if(checks.begin(), checks.end(),
                       [](const SimCheck& c) { return std::abs(c.error()) <= kSimTolerance; });
}

// The simulated figure `sim_key` of `sim` against the measured step of the runs with as many ranks as it has
// devices: absolute times, and the ratios baseline / DMuon, which cancel the machine's load.
std::pair<std::vector<SimCheck>, std::vector<SimCheck>> sim_checks(const Value& sim, const OptimizerRuns& runs,
                                                                   const char* sim_key) {
  std::vector<SimCheck> absolute, ratios;
  for (const auto& row : sim["results"].list()) {
    const auto run = runs.find(static_cast<int>(row["devices"].integer()));
    if (run == runs.end() || !run->second) continue;
    const int np = run->first;
    const bool oversubscribed = (*run->second)["oversubscribed"].flag();
    const auto measured = by_optimizer(*run->second);
    const auto measured_s = [&](const std::string& name) { return measured.at(name)["step_s_median"].num(); };
    for (const auto& name : optim_bench::optimizer_names())
      if (measured.count(name) && row.has(name))
        absolute.push_back({np, name, measured_s(name), simulated(row, name, sim_key), oversubscribed});
    if (!measured.count("dmuon")) continue;
    for (const std::string name : {"muon-gather-plain", "muon-gather"})
      if (measured.count(name) && row.has(name))
        ratios.push_back({np, name + " / dmuon", measured_s(name) / measured_s("dmuon"),
                          simulated(row, name, sim_key) / simulated(row, "dmuon", sim_key), oversubscribed});
  }
  return {absolute, ratios};
}

// The two tables of one validation (absolute steps, then ratios) and the counts within tolerance.
void validation_tables(Report& r, const std::vector<SimCheck>& absolute, const std::vector<SimCheck>& ratios) {
  const Column<SimCheck> error = {"error", [](const SimCheck& c) { return pct(c.error()); }};
  table<SimCheck>(
      r,
      {{"np", [](const SimCheck& c) { return std::to_string(c.np) + (c.oversubscribed ? " (oversubscribed)" : ""); }},
       {"optimizer", [](const SimCheck& c) { return c.what; }},
       {"measured ms", [](const SimCheck& c) { return ms(c.measured); }},
       {"simulated ms", [](const SimCheck& c) { return ms(c.simulated); }},
       error},
      absolute);
  r.p(fmt("%zu of %zu within 25%%. Ratios between optimizers measured in one interleaved run cancel the machine's "
          "load, which shifts all optimizers of one run alike (each baseline's step / DMuon's step):",
          count_within(absolute), absolute.size()));
  r.p();
  table<SimCheck>(r,
                  {{"np", [](const SimCheck& c) { return std::to_string(c.np); }},
                   {"ratio", [](const SimCheck& c) { return c.what; }},
                   {"measured", [](const SimCheck& c) { return fmt("%.2fx", c.measured); }},
                   {"simulated", [](const SimCheck& c) { return fmt("%.2fx", c.simulated); }},
                   error},
                  ratios);
  r.p(fmt("%zu of %zu ratios within 25%%.", count_within(ratios), ratios.size()));
  r.p();
}

// "3 of 4 within 25% (np 2 adamw +5%, ...)" for the headline.
std::string validation_summary(const std::vector<SimCheck>& absolute, const std::vector<SimCheck>& ratios) {
  std::vector<std::string> absolute_errors, ratio_errors;
  for (const auto& c : absolute) absolute_errors.push_back(fmt("np %d %s ", c.np, c.what.c_str()) + pct(c.error()));
  for (const auto& c : ratios) ratio_errors.push_back(pct(c.error()));
  return fmt("absolute times %zu of %zu within 25%% (", count_within(absolute), absolute.size()) +
         join(absolute_errors, ", ") +
         fmt("); speedup ratios %zu of %zu within 25%% (", count_within(ratios), ratios.size()) +
         join(ratio_errors, ", ") + ")";
}

// Section 4: the this-cpu profile and the simulator against the measured optimizer steps.
// Section 4's second part: the simulated GPT demo training step against bench e2e's measurements.
void e2e_validation(Report& r, const Inputs& in) {
  r.p("### End to end: the GPT demo");
  r.p();
  const std::string name = "sim-gpt-demo-this-cpu.json";
  const auto sim = in.json(name);
  if (!sim) {
    not_run(r, in, name);
    return;
  }
  OptimizerRuns runs;
  for (int np : {1, 2, 4}) runs[np] = in.json(fmt("e2e-demo-np%d.json", np));
  r.p("`" + in.command(name) + "` against the measured training steps of section 3 (demo, same batch):");
  r.p();
  const auto [absolute, ratios] = sim_checks(*sim, runs, "step_s");
  validation_tables(r, absolute, ratios);
  r.headline.push_back("Simulator with the `this-cpu` profile against measured GPT demo training steps: " +
                       validation_summary(absolute, ratios) + ".");
}

void validation_section(Report& r, const Inputs& in, const OptimizerRuns& runs) {
  const auto profile = in.json("this-cpu.json");
  const auto sim = in.json("sim-this-cpu.json");
  r.p("## 4. Simulator profile `this-cpu` and validation");
  r.p();
  if (!profile || !sim) {
    if (!profile) not_run(r, in, "this-cpu.json");
    if (!sim) not_run(r, in, "sim-this-cpu.json");
    return;
  }
  const Value& hw = *profile;
  r.p("`" + in.command("calibrate-np2.txt") +
      "` writes the profile (here to docs/bench/this-cpu.json; by default to build/models/hardware/this-cpu.json, "
      "which `dmuon simulate --profile this-cpu` finds). Every number's measurement is in its `sources`:");
  r.p();
  std::string measured =
      fmt("sgemm %.0f GFLOP/s per rank, plain-NS efficiency %.2f, AdamW stream %.1f GB/s, link %.2f GB/s, "
          "latency %.1f us, per-call %.1f us",
          hw["ns_flops"].num() / 1e9, hw["ns_efficiency"].num(), hw["hbm_bytes_per_s"].num() / 1e9,
          hw["intra_node_bytes_per_s"].num() / 1e9, hw["intra_node_latency_s"].num() * 1e6,
          hw["kernel_launch_s"].num() * 1e6);
  if (hw.has("syrk_speedup"))
    measured += fmt(", SYRK %.2fx and upper-triangle GEMM %.2fx faster than the full sgemm, GPT forward+backward at "
                    "%.0f%% of the sgemm rate (MFU)",
                    hw["syrk_speedup"].num(), hw["sym_gemm_speedup"].num(), 100 * hw["mfu"].num());
  r.p(measured + ".");
  r.p();
  r.p("`" + in.command("sim-this-cpu.json") +
      "` against the measured optimizer steps of section 1 (error = simulated / measured - 1; goal within 25%):");
  r.p();
  const auto [absolute, ratios] = sim_checks(*sim, runs, "optimizer_s");
  validation_tables(r, absolute, ratios);
  r.headline.push_back("Simulator with the `this-cpu` profile against measured optimizer steps: " +
                       validation_summary(absolute, ratios) + ".");
  e2e_validation(r, in);
}

// The columns of a simulated cluster's table, one row of `dmuon simulate --json` each.
std::vector<Column<Value>> cluster_columns() {
  const auto opt_ms = [](const char* optimizer) {
    return [optimizer](const Value& row) { return ms(simulated(row, optimizer, "optimizer_s")); };
  };
  const auto step_ms = [](const char* optimizer) {
    return [optimizer](const Value& row) { return ms(simulated(row, optimizer, "step_s")); };
  };
  // The baseline's figure `key` / DMuon's.
  const auto speedup = [](const char* baseline, const char* key) {
    return [=](const Value& row) { return fmt("%.2fx", simulated(row, baseline, key) / simulated(row, "dmuon", key)); };
  };
  return {{"devices", [](const Value& row) { return std::to_string(row["devices"].integer()); }},
          {"opt ms gather-plain", opt_ms("muon-gather-plain")},
          {"opt ms dmuon", opt_ms("dmuon")},
          {"DMuon opt speedup", speedup("muon-gather-plain", "optimizer_s")},
          {"vs muon-gather", speedup("muon-gather", "optimizer_s")},
          {"step ms adamw", step_ms("adamw")},
          {"step ms dmuon", step_ms("dmuon")},
          {"DMuon vs AdamW",
           [](const Value& row) {
             return fmt("%+.1f%%", 100 * (simulated(row, "dmuon", "step_s") / simulated(row, "adamw", "step_s") - 1));
           }},
          {"e2e vs gather-plain", speedup("muon-gather-plain", "step_s")}};
}

// Section `number` (5, 6): one model on simulated clusters of 8-256 A800s. Returns its simulation, if it ran.
std::optional<Value> cluster_section(Report& r, const Inputs& in, int number, const std::string& name,
                                     const std::string& title, const std::string& plot) {
  r.p(fmt("## %d. Simulated ", number) + title + " on 8-256 A800s");
  r.p();
  const auto sim = in.json(name);
  if (!sim) {
    not_run(r, in, name);
    return std::nullopt;
  }
  command_line(r, in, name);
  r.p("![" + title + "](" + plot + ")");
  r.p();
  const auto rows = (*sim)["results"].list();
  DMUON_CHECK(!rows.empty(), in.path(name), ": 'results' is empty");
  table(r, cluster_columns(), rows);
  std::vector<double> speedups;
  for (const auto& row : rows)
    speedups.push_back(simulated(row, "muon-gather-plain", "optimizer_s") / simulated(row, "dmuon", "optimizer_s"));
  const auto [lo, hi] = std::minmax_element(speedups.begin(), speedups.end());
  r.p(
      fmt("Optimizer-step speedup over muon-gather-plain: %.2fx - %.2fx (paper: 6.85x - 163x over 8-256 A800s "
          "across its models).",
          *lo, *hi));
  r.p();
  r.headline.push_back(
      fmt("Simulated %s on 8-256 A800s: DMuon's optimizer step %.1fx - %.0fx faster than muon-gather-plain (paper: "
          "6.85x - 163x).",
          title.c_str(), *lo, *hi));
  return sim;
}

// The last section: how the simulated clusters differ from the paper's measurements.
void paper_comparison(Report& r, const std::vector<std::pair<std::string, Value>>& sims) {
  if (sims.empty()) return;
  r.p("## Simulated clusters against the paper: what differs and why");
  r.p();
  for (const auto& [title, sim] : sims) {
    const auto rows = sim["results"].list();
    std::vector<double> e2e, overhead;
    for (const auto& row : rows) {
      e2e.push_back(simulated(row, "muon-gather-plain", "step_s") / simulated(row, "dmuon", "step_s"));
      overhead.push_back(100 * (simulated(row, "dmuon", "step_s") / simulated(row, "adamw", "step_s") - 1));
    }
    const auto [e2e_lo, e2e_hi] = std::minmax_element(e2e.begin(), e2e.end());
    const auto [overhead_lo, overhead_hi] = std::minmax_element(overhead.begin(), overhead.end());
    const Value& first = rows.front();
    const long long devices = first["devices"].integer();
    r.p(
        fmt("- **%s**: at %lld devices the simulated speedup factors into the NS engine (muon-gather-plain / "
            "muon-gather = %.2fx) times owner execution (muon-gather / dmuon = %.2fx, ideal %lldx). End to end over "
            "muon-gather-plain: %.2fx - %.2fx (paper 1.48x - 3.01x); over AdamW: %+.1f%% to %+.1f%% (paper +2%%).",
            title.c_str(), devices,
            simulated(first, "muon-gather-plain", "optimizer_s") / simulated(first, "muon-gather", "optimizer_s"),
            simulated(first, "muon-gather", "optimizer_s") / simulated(first, "dmuon", "optimizer_s"), devices, *e2e_lo,
            *e2e_hi, *overhead_lo, *overhead_hi));
  }
  const Value& any = sims.front().second;
  r.p(fmt("- The lower end is above the paper's 6.85x through the engine factor: Gram space removes most of the "
          "m x n work at these aspect ratios, and symmetric products run %.2fx (SYRK) and %.2fx (upper-triangle "
          "GEMM) faster than a full GEMM in the profile (its sources say where each figure comes from). The owner "
          "factor is close to the ideal D because the model has no stragglers and no framework time; the paper's "
          "measured baseline may also not be the plain recurrence at full GEMM cost that muon-gather-plain is.",
          any["syrk_speedup"].num(), any["sym_gemm_speedup"].num()));
  r.p("- The upper end saturates: once devices outnumber the matrices, DMuon's step is bounded by the largest single "
      "matrix (the plan's lower bound), so 128 and 256 devices give nearly the same DMuon time and the speedup "
      "grows only with the baseline's all-gather. Kernel launches and collective latencies are modelled, but not "
      "per-step framework or synchronisation time, which on a real cluster dominates a step of a few "
      "milliseconds and caps the measured ratio (the paper's 163x).");
  r.p("- DMuon's end-to-end overhead over AdamW is above the paper's +2% for two reasons the tables show. At 8 "
      "devices the owner's Newton-Schulz is not hidden behind forward and backward (the optimizer step runs after "
      "the backward), so it adds its whole time to a step of 4096 tokens per device; more tokens per device shrink "
      "it, as section 3 measures on this machine. At many devices DMuon's owner-aligned units have uneven blocks, "
      "whose collectives (the cheaper of a ring paced by the largest block and per-owner pipelined broadcasts and "
      "reduces) pay more latency than FSDP's even ones (docs/simulator.md).");
  r.p();
}

std::string render(const Inputs& in) {
  OptimizerRuns runs;
  std::optional<Value> first;
  for (int np : {1, 2, 4}) {
    runs[np] = in.json(fmt("optimizer-np%d.json", np));
    if (!first) first = runs[np];
  }
  Report r;
  introduction(r, in, first);
  const size_t headline_at = r.lines.size();
  optimizer_section(r, in, runs);
  ablation_section(r, in);
  e2e_section(r, in);
  validation_section(r, in, runs);
  std::vector<std::pair<std::string, Value>> sims;
  int section = 5;
  for (const auto& [name, title, plot] : {std::tuple{"sim-qwen7b-a800.json", "Qwen2.5-7B", "sim-qwen7b-a800.png"},
                                          std::tuple{"sim-pi0-a800.json", "Pi0", "sim-pi0-a800.png"}})
    if (auto sim = cluster_section(r, in, section++, name, title, plot)) sims.emplace_back(title, *sim);
  paper_comparison(r, sims);

  std::vector<std::string> headline = {"## Headline figures", ""};
  for (const auto& h : r.headline) headline.push_back("- " + h);
  headline.push_back("");
  r.lines.insert(r.lines.begin() + headline_at, headline.begin(), headline.end());
  return join(r.lines, "\n") + "\n";
}

struct Args {
  std::string dir = "docs/bench";
  std::string out;
};

Registration reg("bench", [](CLI::App& bench) {
  auto args = std::make_shared<Args>();
  auto* c = bench.add_subcommand("report", "Write docs/BENCHMARKS.md from the raw output of make bench");
  c->add_option("--dir", args->dir, "Folder of the raw benchmark output (scripts/bench.sh)")->capture_default_str();
  c->add_option("--out", args->out, "Write the report to this file (atomically) instead of stdout");
  c->callback([args] {
    const std::string text = render(Inputs(args->dir));
    if (args->out.empty()) {
      std::fwrite(text.data(), 1, text.size(), stdout);
    } else {
      write_file_atomically(args->out, text);
      std::fprintf(stderr, "%s written\n", args->out.c_str());
    }
  });
});

}  // namespace

}  // namespace dmuon::cli
