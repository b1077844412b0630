// `dmuon bench optimizer` (under mpirun): one optimizer step on a real model's shapes (models/*.json) with
// seeded synthetic gradients, for AdamW, the gather-then-compute baselines and DMuon, side by side in one
// run (optim_bench.hpp: per step the slowest rank, median over steps; traffic from comm::counting).
// --device cuda: the same on one GPU per rank, NCCL between ranks (`mpirun -np N` with N ≤ GPUs per node).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "cli_kit/device_args.hpp"
#include "dmuon/linalg.hpp"
#ifdef DMUON_HAVE_NCCL
#include "dmuon/comm_nccl.hpp"
#endif
#include "cli_kit/model_args.hpp"
#include "optim_bench.hpp"

namespace dmuon::cli {

namespace optimizer {

namespace ob = optim_bench;

constexpr double kMiB = 1024.0 * 1024.0;

struct Args {
  ModelArgs model;
  std::vector<std::string> optimizers = ob::optimizer_names();
  int steps = 5;
  std::string tune_cache;
  bool json = false;
  DeviceArgs device;
};

const ob::Measurement* find(const std::vector<ob::Measurement>& ms, const std::string& name) {
  for (const auto& m : ms)
    if (m.name == name) return &m;
  return nullptr;
}

// Largest relative difference of the weight norms among the Muon variants (they compute the same math).
double muon_norm_spread(const std::vector<ob::Measurement>& ms) {
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& m : ms) {
    if (m.name == "adamw") continue;
    lo = std::min(lo, m.weight_norm);
    hi = std::max(hi, m.weight_norm);
  }
  return hi >= lo && hi > 0 ? (hi - lo) / hi : 0;
}

// This rank's GPU (one per rank, checked on every rank: rank_device), or null on the CPU.
Backend* rank_backend(comm::Comm& world, const DeviceArgs& device) {
  if (!device.gpu()) return nullptr;
#ifdef DMUON_HAVE_NCCL
  return &device.backend(comm::rank_device(world));
#else
  (void)world;
  DMUON_FAIL("--device ", device.device, ": this build of dmuon has no NCCL communicator (configure with CUDA, NCCL)");
#endif
}

// Per optimizer, its fullest rank (the most bytes held between steps) as counted and as the simulator models it, of
// which its pooled Newton–Schulz workspace, and the highest peak a step allocates above what a rank holds.
void print_memory(const std::vector<ob::Measurement>& ms) {
  std::printf("\nmemory per rank (MiB; counted buffers, each optimizer alone before the timed steps): the fullest rank "
              "held between steps,\nthe simulator's model of it (dmuon simulate), of which the pooled Newton-Schulz "
              "workspace, and the most a step allocates above that on any rank\n%-18s %5s %10s %10s %10s %10s\n",
              "optimizer", "rank", "held", "model", "workspace", "step peak");
  for (const auto& m : ms) {
    const auto& held = m.held_bytes_per_rank;
    const size_t r = static_cast<size_t>(std::max_element(held.begin(), held.end()) - held.begin());
    const std::string model =
        m.model_held_bytes_per_rank.empty() ? "-" : std::to_string(m.model_held_bytes_per_rank[r] / kMiB).substr(0, 7);
    std::printf("%-18s %5zu %10.2f %10s %10.2f %10.2f\n", m.name.c_str(), r, held[r] / kMiB, model.c_str(),
                m.ns_workspace_bytes_per_rank[r] / kMiB,
                *std::max_element(m.step_peak_bytes_per_rank.begin(), m.step_peak_bytes_per_rank.end()) / kMiB);
  }
}

void run(const Args& a) {
  auto world = comm::world();
  Backend* gpu = rank_backend(*world, a.device);
  ob::Setup setup = ob::prepare(*world, a.model.load(),
                                a.tune_cache.empty() ? default_tune_cache_path() : a.tune_cache, gpu,
                                a.device.iterates());
  std::vector<ob::Variant> variants;
  for (const auto& name : a.optimizers) variants.push_back(ob::optimizer_variant(setup, name));
  const std::vector<ob::Measurement> ms = ob::measure(world, setup, variants, a.steps);
  if (world->rank() != 0) return;
  const ob::Measurement* dm = find(ms, "dmuon");
  const ob::Measurement* adamw = find(ms, "adamw");
  const auto& tp = setup.threads;

  if (a.json) {
    nlohmann::json out = ob::run_context(a.model.label(), world->size(), tp, a.steps);
    out.update({{"plan",
                 {{"balancer", to_string(setup.milp.balancer)},
                  {"fell_back", setup.milp.fell_back},
                  {"predicted_makespan_s", setup.milp.makespan_s},
                  {"rr_predicted_makespan_s", setup.rr.makespan_s}}},
                {"muon_weight_norm_rel_spread", muon_norm_spread(ms)},
                {"device", gpu ? gpu->description() + ", NCCL" : "cpu, MPI"},
                {"ns_dtype", to_string(a.device.iterates())},
                {"results", nlohmann::json::array()}});
    for (const auto& m : ms) {
      nlohmann::json r = {{"optimizer", m.name},
                          {"step_s_median", m.median_s},
                          {"step_s", m.step_s},
                          {"sent_bytes_per_rank", m.sent_bytes},
                          {"exposed_comm_s", m.blocked_s},
                          {"backward_sent_bytes_per_rank", m.backward_sent_bytes},
                          {"weight_norm", m.weight_norm}};
      if (dm && m.name != "dmuon") r["dmuon_speedup"] = m.median_s / dm->median_s;
      if (!m.ns_s_per_rank.empty()) r["ns_s_per_rank"] = m.ns_s_per_rank;
      if (!m.predicted_ns_s_per_rank.empty()) r["predicted_ns_s_per_rank"] = m.predicted_ns_s_per_rank;
      r["held_bytes_per_rank"] = m.held_bytes_per_rank;
      r["ns_workspace_bytes_per_rank"] = m.ns_workspace_bytes_per_rank;
      r["step_peak_bytes_per_rank"] = m.step_peak_bytes_per_rank;
      if (!m.model_held_bytes_per_rank.empty()) r["model_held_bytes_per_rank"] = m.model_held_bytes_per_rank;
      out["results"].push_back(r);
    }
    if (dm && adamw) out["dmuon_overhead_vs_adamw"] = dm->median_s / adamw->median_s - 1;
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("optimizer step: %s\n", ob::run_line(a.model.label(), world->size(), tp).c_str());
  if (gpu)
    std::printf("one GPU per rank: rank 0 on %s; NCCL between ranks; Newton-Schulz untuned in %s\n",
                gpu->description().c_str(), to_string(a.device.iterates()).c_str());
  else
    std::printf("%s; %s\n", linalg::cpu_model().c_str(), linalg::blas_description().c_str());
  std::printf(
      "per step the slowest rank, median of %d steps, optimizers interleaved step by step; sent = bytes each rank "
      "sends (ring arithmetic on the\n"
      "collectives' sizes); exposed = time blocked in the communicator; DMuon owners: %s%s\n\n",
      a.steps, to_string(setup.milp.balancer).c_str(), setup.milp.fell_back ? " (fell back to LPT)" : "");
  std::printf("%-18s %10s %9s %12s %11s %12s %14s\n", "optimizer", "step ms", "vs AdamW", "DMuon speedup", "sent MB",
              "exposed ms", "weight norm");
  for (const auto& m : ms) {
    const std::string vs = adamw ? std::to_string(m.median_s / adamw->median_s).substr(0, 5) + "x" : "-";
    const std::string sp = dm && m.name != "dmuon" ? std::to_string(m.median_s / dm->median_s).substr(0, 5) + "x" : "";
    std::printf("%-18s %10.2f %9s %12s %11.2f %12.2f %14.6g\n", m.name.c_str(), 1e3 * m.median_s, vs.c_str(),
                sp.c_str(), m.sent_bytes / 1e6, 1e3 * m.blocked_s, m.weight_norm);
  }
  for (const auto& m : ms) {
    if (m.predicted_ns_s_per_rank.empty()) continue;
    std::printf("\n%s: Newton-Schulz per rank, predicted (owner plan from the tune cache) vs measured in the step "
                "(median)\n%6s %14s %13s %10s\n", m.name.c_str(), "rank", "predicted ms", "measured ms", "error");
    for (size_t r = 0; r < m.ns_s_per_rank.size(); ++r) {
      const double p = m.predicted_ns_s_per_rank[r], x = m.ns_s_per_rank[r];
      std::printf("%6zu %14.2f %13.2f %9.1f%%\n", r, 1e3 * p, 1e3 * x, x > 0 ? 100 * (p - x) / x : 0.0);
    }
  }
  print_memory(ms);
  std::printf("\nMuon variants' weight norms agree within %.1e (relative).\n", muon_norm_spread(ms));
  if (dm && adamw) std::printf("DMuon's overhead over AdamW: %+.1f%%\n", 100 * (dm->median_s / adamw->median_s - 1));
}

Registration reg("", [](CLI::App& bench) {
  auto args = std::make_shared<Args>();
  auto* c = bench.add_subcommand("optimizer",
                                 "Optimizer step on a model's shapes: AdamW, gather-then-compute Muon "
                                 "and DMuon side by side (run under mpirun)");
  args->model.add_to(c);
  args->device.add_to(c);
  c->add_option("--optim", args->optimizers,
                               "Optimizers, comma-separated: adamw,muon-gather-plain,muon-gather,dmuon "
                               "(and muon on one rank)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--steps", args->steps, "Timed steps (median reported; one more untimed warm-up)")
      ->capture_default_str()
      ->check(at_least(1));
  c->add_option("--tune-cache", args->tune_cache, kTuneCacheHelp);
  c->add_flag("--json", args->json, "Print one JSON object instead of the table");
  c->callback([args] {
    for (const auto& name : args->optimizers) optim_bench::optimizer_spec(name);  // throws for an unknown name
    run(*args);
  });
});

}  // namespace optimizer

}  // namespace dmuon::cli
