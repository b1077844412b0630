// Section 4 of docs/BENCHMARKS.md: the this-cpu profile and the simulator against the measured steps
// (sections.hpp).
#include "sections.hpp"


#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace dmuon::bench_report {

namespace {

// Simulated figures within this relative error of the measured ones count as matching.
constexpr double kSimTolerance = 0.25;

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
    for (const auto& name : compared_optimizer_names())
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
  r.p(std::string("`") + in.command(name) + "` against the measured training steps of section 3 (demo, same batch):");
  r.p();
  const auto [absolute, ratios] = sim_checks(*sim, runs, "step_s");
  validation_tables(r, absolute, ratios);
  r.headline.push_back("Simulator with the `this-cpu` profile against measured GPT demo training steps: " +
                       validation_summary(absolute, ratios) + ".");
}

}  // namespace

// Section 4: the this-cpu profile and the simulator against the measured optimizer steps.
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
  r.p(std::string("`") + in.command("calibrate-np2.txt") +
      "` writes the profile (here to docs/bench/this-cpu.json; by default to build/models/hardware/this-cpu.json, "
      "which `simulate --profile this-cpu` finds). Every number's measurement is in its `sources`:");
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
  r.p(std::string("`") + in.command("sim-this-cpu.json") +
      "` against the measured optimizer steps of section 1 (error = simulated / measured - 1; goal within 25%):");
  r.p();
  const auto [absolute, ratios] = sim_checks(*sim, runs, "optimizer_s");
  validation_tables(r, absolute, ratios);
  r.headline.push_back("Simulator with the `this-cpu` profile against measured optimizer steps: " +
                       validation_summary(absolute, ratios) + ".");
  e2e_validation(r, in);
}

}  // namespace dmuon::bench_report
