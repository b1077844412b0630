// dmuon-bench-report: docs/BENCHMARKS.md from what `make bench` (scripts/bench.sh) leaves in docs/bench/:
// <name>.json, the output of one benchmark command; <name>.cmd, that command's line; date.txt.
// A benchmark whose file is missing or holds no JSON (a run cut short) gets a note in place of its section, so a
// partial run still gives a report; with --out, the sections written by hand below kHandWritten in the file it
// replaces are kept after the generated ones; a malformed file, a missing key or a wrong type is an error naming the file
// and the key. A developer tool beside the benchmarks (bench/), not part of the dmuon binary.
// The sections live in bench/report/ (sections.hpp), written with document.hpp's table writer.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "sections.hpp"

namespace dmuon::bench_report {
namespace {

// The line after which docs/BENCHMARKS.md holds sections measured by hand, each with its own command.
constexpr const char* kHandWritten =
    "<!-- Sections below: measured by hand, each with its command; make bench regenerates what is above and keeps them. -->";

// The hand-written tail of the report at `path` (from kHandWritten's line on), "" when it has none.
std::string hand_written_tail(const std::string& path) {
  if (!std::filesystem::exists(path)) return "";
  const std::string text = read_file(path);
  const size_t at = text.find(std::string(kHandWritten) + "\n");
  return at == std::string::npos ? "" : "\n" + text.substr(at);
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

}  // namespace
}  // namespace dmuon::bench_report

int main(int argc, char** argv) {
  CLI::App app{"dmuon-bench-report: write docs/BENCHMARKS.md from the raw output of make bench (scripts/bench.sh)"};
  std::string dir = "docs/bench", out;
  app.add_option("--dir", dir, "Folder of the raw benchmark output (scripts/bench.sh)")->capture_default_str();
  app.add_option("--out", out, "Write the report to this file (atomically) instead of stdout (default: stdout)");
  CLI11_PARSE(app, argc, argv);
  try {
    const std::string text = dmuon::bench_report::render(dmuon::bench_report::Inputs(dir));
    if (out.empty()) {
      std::fwrite(text.data(), 1, text.size(), stdout);
    } else {
      dmuon::write_file_atomically(out, text + dmuon::bench_report::hand_written_tail(out));
      std::fprintf(stderr, "%s written\n", out.c_str());
    }
  } catch (const dmuon::Error& e) {
    std::fprintf(stderr, "dmuon-bench-report: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmuon-bench-report: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
