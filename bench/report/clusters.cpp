// Sections 5 and 6 of docs/BENCHMARKS.md, models on simulated A800 clusters, and the comparison with the
// paper (sections.hpp).
#include "sections.hpp"

#include <algorithm>
#include <string>
#include <vector>

namespace dmuon::bench_report {

namespace {

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

}  // namespace

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

}  // namespace dmuon::bench_report
