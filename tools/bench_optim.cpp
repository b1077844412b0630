// `dmuon bench optim` (under mpirun): the optimizer step of a synthetic transformer's parameters —
// per layer q, k, v, o (H×H), up (4H×H), down (H×4H) and two norms, plus a V×H embedding — with
// AdamW on everything, the gather-then-compute Muon baseline (DESIGN 3.2, even layout) and DMuon
// (owner-aligned layout, owners from shard::lpt_owners). Each step's time is the slowest rank's;
// the table gives the median over steps and the ratio to AdamW. Gradients are reduced through the
// sharded-parameter hooks before each step, outside the timed region.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "dmuon/distributed_optim.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct BenchArgs {
  int layers = 4, hidden = 256, steps = 5, threads = 1;
  std::string algo = "auto";
  bool json = false;
};

std::vector<dmuon::ParamSpec> transformer(int layers, int64_t h) {
  std::vector<dmuon::ParamSpec> specs = {{"embed", {4 * h, h}, dmuon::ParamRole::elementwise, 0}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const char* m : {"q", "k", "v", "o"}) specs.push_back({p + m, {h, h}, dmuon::ParamRole::matrix, l + 1});
    specs.push_back({p + "up", {4 * h, h}, dmuon::ParamRole::matrix, l + 1});
    specs.push_back({p + "down", {h, 4 * h}, dmuon::ParamRole::matrix, l + 1});
    specs.push_back({p + "norm1", {h}, dmuon::ParamRole::elementwise, l + 1});
    specs.push_back({p + "norm2", {h}, dmuon::ParamRole::elementwise, l + 1});
  }
  return specs;
}

// One backward's worth of reduced gradients (random, the same every step) through the hooks.
void backward(dmuon::shard::ShardedParams& sp) {
  std::mt19937 rng(sp.registry().size());
  std::normal_distribution<float> normal;
  for (int u = sp.num_units() - 1; u >= 0; --u) {
    sp.before_backward(u);
    for (int p : sp.layout(u).params) {
      for (float& g : sp.grad(p)) g = normal(rng);
    }
    sp.after_backward(u);
  }
  sp.finish_backward();
}

struct Result {
  std::string variant;
  double median_s = 0;
};

Result bench_variant(const std::string& variant, const BenchArgs& args, const std::shared_ptr<dmuon::comm::Comm>& comm) {
  namespace shard = dmuon::shard;
  shard::ParamRegistry reg;
  for (const auto& s : transformer(args.layers, args.hidden)) reg.add(s);
  const shard::Layout layout = variant == "DMuon" ? shard::Layout::owner_aligned : shard::Layout::even;
  shard::ShardedParams sp(comm, reg, {layout, shard::Mode::z2, dmuon::comm::ReduceOp::average, true});
  dmuon::OptimizerOptions opt;
  opt.muon.ns.algo = dmuon::parse_ns_algo(args.algo);
  std::unique_ptr<dmuon::Optimizer> optimizer;
  if (variant == "AdamW") {
    optimizer = std::make_unique<dmuon::ShardedAdamW>(comm, sp, opt);
  } else if (variant == "MuonGatherCompute") {
    optimizer = std::make_unique<dmuon::MuonGatherCompute>(comm, sp, opt);
  } else {
    optimizer = std::make_unique<dmuon::DMuon>(comm, sp, opt);
  }
  std::vector<double> times;
  for (int s = 0; s <= args.steps; ++s) {  // step 0 warms up
    backward(sp);
    std::vector<double> t = {0};
    t[0] = -1;
    comm->all_reduce<double>(t, dmuon::comm::ReduceOp::max).wait();  // start together
    const auto t0 = Clock::now();
    optimizer->step();
    t[0] = std::chrono::duration<double>(Clock::now() - t0).count();
    comm->all_reduce<double>(t, dmuon::comm::ReduceOp::max).wait();
    if (s > 0) times.push_back(t[0]);
  }
  std::sort(times.begin(), times.end());
  return {variant, times[times.size() / 2]};
}

void run_bench(const BenchArgs& args) {
  DMUON_CHECK(args.layers >= 1 && args.hidden >= 1 && args.steps >= 1 && args.threads >= 1,
              "--layers, --hidden, --steps and --threads must be ≥ 1");
  dmuon::linalg::set_threads(args.threads);
  auto comm = dmuon::comm::world();
  std::vector<Result> results;
  for (const char* v : {"AdamW", "MuonGatherCompute", "DMuon"}) results.push_back(bench_variant(v, args, comm));
  if (comm->rank() != 0) return;
  if (args.json) {
    nlohmann::json j = {{"world_size", comm->size()}, {"layers", args.layers}, {"hidden", args.hidden},
                        {"steps", args.steps},         {"threads", args.threads}, {"algo", args.algo}};
    for (const Result& r : results) j["results"].push_back({{"variant", r.variant}, {"step_s_median", r.median_s}});
    std::printf("%s\n", j.dump(1).c_str());
    return;
  }
  std::printf("optimizer step, %d ranks, %d layers, hidden %d, NS %s, %d BLAS thread(s)/rank; median of %d steps, "
              "slowest rank\n",
              comm->size(), args.layers, args.hidden, args.algo.c_str(), args.threads, args.steps);
  std::printf("%-20s %12s %10s\n", "variant", "step ms", "vs AdamW");
  for (const Result& r : results) {
    std::printf("%-20s %12.2f %9.2fx\n", r.variant.c_str(), 1e3 * r.median_s, r.median_s / results[0].median_s);
  }
}

dmuon::cli::Registration reg("bench", [](CLI::App& bench) {
  auto args = std::make_shared<BenchArgs>();
  auto* c = bench.add_subcommand("optim", "Optimizer step: AdamW vs gather-then-compute Muon vs DMuon (mpirun)");
  c->add_option("--layers", args->layers, "transformer layers")->capture_default_str();
  c->add_option("--hidden", args->hidden, "hidden size H")->capture_default_str();
  c->add_option("--steps", args->steps, "timed steps (median reported)")->capture_default_str();
  c->add_option("--threads", args->threads, "BLAS threads per rank")->capture_default_str();
  c->add_option("--algo", args->algo, "NS algorithm: standard | gram | auto")->capture_default_str();
  c->add_flag("--json", args->json, "print one JSON object instead of the table");
  c->callback([args] { run_bench(*args); });
});

}  // namespace
