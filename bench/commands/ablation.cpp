// `dmuon bench ablation` (under mpirun): DMuon's optimizer step with each of its parts removed in turn,
// side by side in one run, and the share of the speedup each part accounts for.
//
// Each variant runs interleaved with DMuon (optim_bench.hpp), and its slowdown t_i / t_full compares the two.
// Share (log-time attribution): with t_full DMuon's step and t_i the step without part i,
//   share_i = max(0, ln(t_i / t_full)) / Σ_j max(0, ln(t_j / t_full)).
// A part whose removal does not slow the step (ratio ≤ 1, i.e. within noise or harmful) gets share 0.
// Log attribution makes the shares of independent multiplicative speedups add up regardless of the
// order in which parts are removed; it ignores interactions between parts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/statistics.hpp"
#include "cli_kit/model_args.hpp"
#include "optim_bench.hpp"

namespace dmuon::cli {

namespace ablation {

namespace ob = optim_bench;

struct Args {
  ModelArgs model;
  int steps = 3;
  std::string tune_cache;
  bool json = false;
};

struct Part {
  std::string removed;  // the part taken away
  std::string group;    // the paper's grouping of its speedup shares
  double paper_share;   // the paper's share of that group (%)
  ob::Variant variant;
};

std::vector<Part> parts(const ob::Setup& s) {
  using ob::Engine;
  const std::vector<int>& milp = s.milp.owner;
  return {
      {"symmetric products", "symmetric kernels", 48, {"no-symmetric", OptimKind::dmuon, Engine::tuned_gemm, true, milp}},
      {"Gram space", "symmetric kernels", 48, {"no-gram", OptimKind::dmuon, Engine::tuned_standard, true, milp}},
      {"batching", "autotuning + batching", 16, {"no-batching", OptimKind::dmuon, Engine::tuned, false, milp}},
      {"autotuning", "autotuning + batching", 16, {"no-tuning", OptimKind::dmuon, Engine::untuned, true, milp}},
      {"MILP balancing",
       "owner scheduling + load balancing",
       32,
       {"rr-owners", OptimKind::dmuon, Engine::tuned, true, s.rr.owner}},
      {"owner execution",
       "owner scheduling + load balancing",
       32,
       {"gather-compute", OptimKind::muon_gather, Engine::tuned, true, {}}},
  };
}

void run(const Args& a) {
  auto world = comm::world();
  const ob::Setup setup =
      ob::prepare(*world, a.model.load(), a.tune_cache.empty() ? default_tune_cache_path() : a.tune_cache);
  const std::vector<Part> ps = parts(setup);
  // Every variant runs interleaved with DMuon itself, so each slowdown compares steps taken under the same load.
  const ob::Variant dmuon = ob::optimizer_variant(setup, "dmuon");
  std::vector<double> full_times;
  auto against_full = [&](const ob::Variant& v) {
    const auto pair = ob::measure(world, setup, {dmuon, v}, a.steps);
    full_times.push_back(pair[0].median_s);
    return std::make_pair(pair[1], pair[1].median_s / pair[0].median_s);
  };
  const auto [plain, plain_ratio] = against_full(ob::optimizer_variant(setup, "muon-gather-plain"));
  std::vector<ob::Measurement> without;
  std::vector<double> slowdown;
  for (const Part& p : ps) {
    const auto [m, ratio] = against_full(p.variant);
    without.push_back(m);
    slowdown.push_back(ratio);
  }
  if (world->rank() != 0) return;
  const double full_s = median(full_times);

  std::vector<double> logs;
  double total = 0;
  for (double r : slowdown) {
    logs.push_back(std::max(0.0, std::log(r)));
    total += logs.back();
  }
  auto share = [&](size_t i) { return total > 0 ? 100 * logs[i] / total : 0.0; };
  std::map<std::string, double> group_share;
  for (size_t i = 0; i < ps.size(); ++i) group_share[ps[i].group] += share(i);
  const auto& tp = setup.threads;

  if (a.json) {
    nlohmann::json out = ob::run_context(a.model.label(), world->size(), tp, a.steps);
    out.update({{"share_definition", "share_i = max(0, ln(t_without_i/t_full)) / sum_j max(0, ln(t_without_j/t_full))"},
                {"dmuon_step_s", full_s},
                {"muon_gather_plain_step_s", plain.median_s},
                {"muon_gather_plain_slowdown", plain_ratio},
                {"parts", nlohmann::json::array()},
                {"groups", nlohmann::json::array()}});
    for (size_t i = 0; i < ps.size(); ++i) {
      out["parts"].push_back({{"removed", ps[i].removed},
                              {"variant", without[i].name},
                              {"group", ps[i].group},
                              {"step_s", without[i].median_s},
                              {"slowdown", slowdown[i]},
                              {"share_pct", share(i)},
                              {"weight_norm", without[i].weight_norm}});
    }
    for (const Part& p : ps) {
      if (!out["groups"].empty() && out["groups"].back()["group"] == p.group) continue;
      out["groups"].push_back(
          {{"group", p.group}, {"share_pct", group_share[p.group]}, {"paper_share_pct", p.paper_share}});
    }
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("ablation: %s; median of %d steps, slowest rank\n",
              ob::run_line(a.model.label(), world->size(), tp).c_str(), a.steps);
  std::printf(
      "DMuon %.2f ms (median of its runs beside each variant); muon-gather-plain (paper baseline) %.2f ms = "
      "%.2fx\n",
      1e3 * full_s, 1e3 * plain.median_s, plain.median_s / full_s);
  std::printf("slowdown = a variant's step / DMuon's step, the two run interleaved\n");
  std::printf("share_i = max(0, ln(t_without_i / t_full)) / sum_j max(0, ln(t_without_j / t_full))\n\n");
  std::printf("%-20s %-16s %10s %9s %8s   %-34s %8s %8s\n", "removed", "variant", "step ms", "slowdown", "share",
              "paper group", "ours", "paper");
  for (size_t i = 0; i < ps.size(); ++i) {
    std::printf("%-20s %-16s %10.2f %8.2fx %7.1f%%   %-34s %7.1f%% %7.0f%%\n", ps[i].removed.c_str(),
                without[i].name.c_str(), 1e3 * without[i].median_s, slowdown[i], share(i), ps[i].group.c_str(),
                group_share[ps[i].group], ps[i].paper_share);
  }
}

Registration reg("", [](CLI::App& bench) {
  auto args = std::make_shared<Args>();
  auto* c = bench.add_subcommand("ablation",
                                 "DMuon's optimizer step with each part removed in turn, and each "
                                 "part's share of the speedup (run under mpirun)");
  args->model.add_to(c);
  c->add_option("--steps", args->steps, "Timed steps per variant (median reported)")
      ->capture_default_str()
      ->check(at_least(1));
  c->add_option("--tune-cache", args->tune_cache, kTuneCacheHelp);
  c->add_flag("--json", args->json, "Print one JSON object instead of the table");
  c->callback([args] { run(*args); });
});

}  // namespace ablation

}  // namespace dmuon::cli
