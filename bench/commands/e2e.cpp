// `dmuon bench e2e` (under mpirun): end-to-end training step time of the GPT example (the Trainer of
// include/dmuon/trainer.hpp, the loop behind `dmuon train`) for AdamW, the paper's gather-then-compute
// baseline with plain NS, and DMuon, side by side in one run (all trainers alive, stepped in turn). Per step the
// slowest rank (StepMetrics); the median over the timed steps after `--warmup` untimed ones. Configurations: `demo`
// (make demo's model and batch: L4 C128 NH4 T64 B64) and `large` (L6 C256 NH4 T128 B16); `--batch` overrides B.
// Newton–Schulz costs the same per step whatever B, so DMuon's overhead over AdamW falls as B grows.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/statistics.hpp"
#include "dmuon/trainer.hpp"
#include "cli_kit/e2e_configs.hpp"
#include "optim_bench.hpp"

namespace dmuon::cli {

namespace e2e {

struct Args {
  std::string config = "demo";
  int64_t batch = 0;  // sequences per step; 0: the configuration's
  std::vector<std::string> optimizers = {"adamw", "muon-gather-plain", "dmuon"};
  int steps = 6;
  int warmup = 2;
  bool json = false;
  bool tune = true;        // muon-gather and dmuon: tuned NS and (dmuon) measured owner costs, as `dmuon train`
  std::string tune_cache;  // empty: default_tune_cache_path()
};

TrainOptions train_options(const Args& a, const std::string& optimizer) {
  TrainOptions o;
  const E2eConfig config = e2e_config(a.config);
  o.model = config.model;
  o.batch = a.batch > 0 ? a.batch : config.batch;
  o.warmup = 0;
  o.val_every = 0;
  o.val_batches = 1;
  o.steps = a.warmup + a.steps + 1;  // the last step (which validates) is never run
  namespace ob = optim_bench;
  const ob::Variant& variant = ob::optimizer_spec(optimizer);
  o.optim = variant.kind;
  if (variant.engine == ob::Engine::plain) {
    o.ns.algo = NsAlgo::standard;
    o.ns.symmetric = false;
  } else if (o.optim != OptimKind::adamw) {
    o.tune = a.tune;
  }
  o.tune_cache = a.tune_cache;
  o.tune_warn = [](const std::string& warning) { std::fprintf(stderr, "dmuon: warning: %s\n", warning.c_str()); };
  return o;
}

struct Result {
  std::string name;
  double step_s = 0, fwd_bwd_s = 0, optim_s = 0, comm_wait_s = 0;
};

void run(const Args& a) {
  auto world = comm::world();
  const auto policy = optim_bench::thread_policy(world->size());
  linalg::set_threads(policy.threads_per_rank);
  // All trainers alive at once, stepped in turn, so load changes on a shared machine reach each alike.
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (const auto& name : a.optimizers)
    trainers.push_back(std::make_unique<Trainer>(train_options(a, name), comm::world()));  // own communicator
  std::vector<std::vector<StepMetrics>> metrics(trainers.size());
  for (int s = 0; s < a.warmup + a.steps; ++s)
    for (size_t i = 0; i < trainers.size(); ++i) {
      const StepMetrics m = trainers[i]->train_step();
      if (s >= a.warmup) metrics[i].push_back(m);
    }
  std::vector<Result> results;
  for (size_t i = 0; i < trainers.size(); ++i) {
    auto med = [&](double StepMetrics::*field) {
      std::vector<double> x;
      for (const auto& m : metrics[i]) x.push_back(m.*field);
      return median(x);
    };
    results.push_back({a.optimizers[i], med(&StepMetrics::step_s), med(&StepMetrics::fwd_bwd_s),
                       med(&StepMetrics::optim_s), med(&StepMetrics::comm_wait_s)});
  }
  if (world->rank() != 0) return;
  auto find = [&](const std::string& n) -> const Result* {
    for (const auto& r : results)
      if (r.name == n) return &r;
    return nullptr;
  };
  const Result* dm = find("dmuon");
  const Result* adamw = find("adamw");
  const int64_t batch = trainers.front()->options().batch;
  const std::string label = "GPT " + a.config + ", " + std::to_string(batch) + " sequences per step";
  if (a.json) {
    nlohmann::json out = optim_bench::run_context(label, world->size(), policy, a.steps);
    out["batch"] = batch;
    out["tokens_per_step"] = batch * trainers.front()->options().model.context;
    out["tuned"] = a.tune;
    out["results"] = nlohmann::json::array();
    for (const auto& r : results) {
      nlohmann::json j = {{"optimizer", r.name},
                          {"step_s_median", r.step_s},
                          {"fwd_bwd_s", r.fwd_bwd_s},
                          {"optimizer_s", r.optim_s},
                          {"comm_wait_s", r.comm_wait_s}};
      if (dm && r.name != "dmuon") j["dmuon_speedup"] = r.step_s / dm->step_s;
      out["results"].push_back(j);
    }
    if (dm && adamw) out["dmuon_overhead_vs_adamw"] = dm->step_s / adamw->step_s - 1;
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("training step: %s; median of %d steps after %d warm-up, slowest rank; muon-gather and dmuon %s\n\n",
              optim_bench::run_line(label, world->size(), policy).c_str(), a.steps, a.warmup,
              a.tune ? "tuned (NS kernels, dmuon's owners from measured costs)" : "untuned (--no-tune)");
  std::printf("%-18s %10s %10s %10s %10s %10s %12s\n", "optimizer", "step ms", "fwd+bwd", "optimizer", "comm wait",
              "vs AdamW", "DMuon speedup");
  for (const auto& r : results) {
    std::printf("%-18s %10.2f %10.2f %10.2f %10.2f %9.3fx %12s\n", r.name.c_str(), 1e3 * r.step_s, 1e3 * r.fwd_bwd_s,
                1e3 * r.optim_s, 1e3 * r.comm_wait_s, adamw ? r.step_s / adamw->step_s : 0.0,
                dm && r.name != "dmuon" ? (std::to_string(r.step_s / dm->step_s).substr(0, 5) + "x").c_str() : "");
  }
  if (dm && adamw) std::printf("\nDMuon's overhead over AdamW: %+.1f%%\n", 100 * (dm->step_s / adamw->step_s - 1));
}

Registration reg("", [](CLI::App& bench) {
  auto args = std::make_shared<Args>();
  auto* c = bench.add_subcommand("e2e",
                                 "Training step of the GPT example: AdamW, gather-then-compute Muon (plain NS) "
                                 "and DMuon side by side (run under mpirun)");
  c->add_option("--config", args->config, "demo (L4 C128 T64 B64) or large (L6 C256 T128 B16)")->capture_default_str();
  c->add_option("--batch", args->batch, "Sequences per step (default: the configuration's)")->check(positive());
  c->add_option("--optim", args->optimizers, "Optimizers, comma-separated: adamw,muon-gather-plain,muon-gather,dmuon")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--steps", args->steps, "Timed steps (median reported)")
      ->capture_default_str()
      ->check(at_least(1));
  c->add_option("--warmup", args->warmup, "Untimed steps first")->capture_default_str()->check(at_least(0));
  c->add_flag("--json", args->json, "Print one JSON object instead of the table");
  add_tune_flags(c, args->tune, "muon-gather and dmuon: tuned NS kernels, dmuon's owners from measured costs (as dmuon train)");
  c->add_option("--tune-cache", args->tune_cache, kTuneCacheHelp);
  c->callback([args] { run(*args); });
});

}  // namespace e2e

}  // namespace dmuon::cli
