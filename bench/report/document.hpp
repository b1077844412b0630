// The pieces every section of dmuon-bench-report is written with: the raw-output folder and its JSON
// values (errors name the file and the key), and the Markdown document with its table writer.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/error.hpp"

namespace dmuon::bench_report {

__attribute__((format(printf, 1, 2))) std::string fmt(const char* format, ...);
std::string ms(double seconds);    // "12.3" (milliseconds, one decimal)
std::string pct(double fraction);  // "+12%"
std::string join(const std::vector<std::string>& parts, const std::string& separator);
std::string trim(const std::string& s);
// The benchmarks' optimizers in table order: the simulator's compared list (sim.hpp), which every benchmark runs.
const std::vector<std::string>& compared_optimizer_names();

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
std::map<std::string, Value> by_optimizer(const Value& run);
// The result row of `optimizer` in a benchmark run.
Value result(const Value& run, const std::string& optimizer);
// An optimizer's figure `key` ("step_s", "optimizer_s", ...) in one row of `dmuon simulate --json`.
double simulated(const Value& row, const std::string& optimizer, const char* key);

// The folder of raw benchmark output.
class Inputs {
 public:
  explicit Inputs(std::string dir);
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // The JSON object in `name` (commands may print lines around it); nullopt when the file is missing or holds
  // no object (a run cut short).
  std::optional<Value> json(const std::string& name) const;
  // The command line bench.sh recorded for output `name`.
  std::string command(const std::string& name) const { return text_or(name + ".cmd", "(not run)"); }
  std::string date() const { return text_or("date.txt", "?"); }

 private:
  std::string text_or(const std::string& name, const std::string& fallback) const;
  std::string dir_;
};

using OptimizerRuns = std::map<int, std::optional<Value>>;  // `bench optimizer` runs by rank count

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

// The command line that produced output `name`, as a code span.
void command_line(Report& r, const Inputs& in, const std::string& name);
// In place of a section whose input is missing.
void not_run(Report& r, const Inputs& in, const std::string& name);
// A benchmark run's heading, command line and results table: the optimizer, its step, `columns`, its step over
// AdamW's and DMuon's speedup over it.
void results_table(Report& r, const Inputs& in, const Value& run, const std::string& title, const std::string& name,
                   const std::vector<Column<Value>>& columns);

}  // namespace dmuon::bench_report
