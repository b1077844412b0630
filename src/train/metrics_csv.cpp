#include "dmuon/metrics_csv.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"

namespace dmuon {

namespace {
constexpr const char* kHeader = "step,train_loss,val_loss,step_s,fwd_bwd_s,optim_s,comm_wait_s";
constexpr int kColumns = 7;

// %.9g: enough digits to read a float32 loss back exactly, and plain for spreadsheets.
std::string number(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

void write_row(std::ostream& out, const StepMetrics& r) {
  out << r.step << ',' << number(r.train_loss) << ',' << (r.val_loss ? number(*r.val_loss) : "") << ','
      << number(r.step_s) << ',' << number(r.fwd_bwd_s) << ',' << number(r.optim_s) << ',' << number(r.comm_wait_s)
      << '\n';
}

double parse_number(const std::string& field, const std::string& path, int line, const char* column) {
  char* end = nullptr;
  const double x = std::strtod(field.c_str(), &end);
  DMUON_CHECK(!field.empty() && end == field.c_str() + field.size(), "metrics file ", path, " line ", line, ": column ",
              column, " is not a number: '", field, "'");
  return x;
}

// A step number: a decimal integer (converting a double beyond int64 would be undefined).
int64_t parse_step(const std::string& field, const std::string& path, int line) {
  int64_t step = 0;
  const auto [end, error] = std::from_chars(field.data(), field.data() + field.size(), step);
  DMUON_CHECK(!field.empty() && error == std::errc() && end == field.data() + field.size(), "metrics file ", path,
              " line ", line, ": column step is not a whole number: '", field, "'");
  return step;
}

// The file's text when it exists and is a regular file; "" otherwise (/dev/null, a FIFO, no file).
std::string existing_text(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec) ? read_file(path) : std::string();
}

bool is_metrics_text(const std::string& text) {
  return text.empty() || text.compare(0, std::string(kHeader).size() + 1, std::string(kHeader) + "\n") == 0;
}
}  // namespace

void MetricsCsvWriter::check(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  // A device or pipe (/dev/null) is written in place: it only needs to be writable.
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status) &&
      !std::filesystem::is_directory(status)) {
    DMUON_CHECK(::access(path.c_str(), W_OK) == 0, "cannot write metrics file ", path, ": ", std::strerror(errno));
    return;
  }
  const std::string why = why_cannot_write(path);
  DMUON_CHECK(why.empty(), "cannot write metrics file ", path, ": ", why);
  DMUON_CHECK(is_metrics_text(existing_text(path)), "metrics file ", path,
              " exists and is not a metrics file (its first line is not '", kHeader, "'); refusing to replace it");
}

MetricsCsvWriter::MetricsCsvWriter(const std::string& path, std::optional<int64_t> resume_after) : path_(path) {
  check(path);
  const std::string text = existing_text(path);
  if (resume_after && !text.empty()) {
    // Keep the earlier run's rows up to the checkpoint's step, then append.
    std::string kept = std::string(kHeader) + "\n";
    bool dropped = false;
    for (const StepMetrics& r : read_metrics_csv(path)) {
      if (r.step > *resume_after) {
        dropped = true;
        continue;
      }
      std::ostringstream row;
      write_row(row, r);
      kept += row.str();
    }
    if (dropped) write_file_atomically(path, kept);
    out_.open(path, std::ios::app);
    DMUON_CHECK(out_.good(), "cannot append to metrics file ", path);
    return;
  }
  out_.open(path, std::ios::trunc);
  DMUON_CHECK(out_.good(), "cannot create metrics file ", path);
  out_ << kHeader << '\n' << std::flush;
  DMUON_CHECK(out_.good(), "cannot write metrics file ", path);
}

void MetricsCsvWriter::write(const StepMetrics& r) {
  write_row(out_, r);
  out_ << std::flush;
  DMUON_CHECK(out_.good(), "cannot write metrics file ", path_);
}

std::vector<StepMetrics> read_metrics_csv(const std::string& path) {
  std::istringstream in(read_file(path));
  std::string line;
  DMUON_CHECK(std::getline(in, line) && line == kHeader, "metrics file ", path, " does not start with the header '",
              kHeader, "'");
  std::vector<StepMetrics> rows;
  for (int number = 2; std::getline(in, line); number++) {
    if (line.empty()) continue;
    std::vector<std::string> f;
    std::istringstream fields(line);
    for (std::string s; std::getline(fields, s, ',');) f.push_back(s);
    if (!line.empty() && line.back() == ',') f.emplace_back();
    DMUON_CHECK(f.size() == kColumns, "metrics file ", path, " line ", number, ": expected ", kColumns,
                " columns, got ", f.size());
    StepMetrics r;
    r.step = parse_step(f[0], path, number);
    r.train_loss = parse_number(f[1], path, number, "train_loss");
    if (!f[2].empty()) r.val_loss = parse_number(f[2], path, number, "val_loss");
    r.step_s = parse_number(f[3], path, number, "step_s");
    r.fwd_bwd_s = parse_number(f[4], path, number, "fwd_bwd_s");
    r.optim_s = parse_number(f[5], path, number, "optim_s");
    r.comm_wait_s = parse_number(f[6], path, number, "comm_wait_s");
    rows.push_back(r);
  }
  return rows;
}

RunSummary summarize_run(const std::vector<StepMetrics>& rows) {
  RunSummary s;
  s.steps = static_cast<int64_t>(rows.size());
  std::vector<double> step, fwd_bwd, optim, comm;
  for (const StepMetrics& r : rows) {
    step.push_back(r.step_s);
    fwd_bwd.push_back(r.fwd_bwd_s);
    optim.push_back(r.optim_s);
    comm.push_back(r.comm_wait_s);
    if (r.val_loss) s.val_loss = r.val_loss, s.val_step = r.step;
  }
  s.step_s = median(step), s.fwd_bwd_s = median(fwd_bwd), s.optim_s = median(optim), s.comm_wait_s = median(comm);
  return s;
}

}  // namespace dmuon
