// The optimizer-step harness of `dmuon bench optimizer` and `dmuon bench ablation` (optim_bench.hpp).
#include "optim_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <thread>

#include "dmuon/error.hpp"
#ifdef DMUON_HAVE_NCCL
#include "dmuon/comm_nccl.hpp"
#endif
#include "dmuon/linalg.hpp"
#include "dmuon/plan_across_ranks.hpp"
#include "dmuon/shard.hpp"
#include "dmuon/sim.hpp"
#include "dmuon/statistics.hpp"

namespace dmuon::cli::optim_bench {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<TuneRequest> shape_requests(const std::vector<ParamSpec>& params) {
  std::map<std::pair<int64_t, int64_t>, bool> shapes;
  for (const auto& p : params)
    if (p.role == ParamRole::matrix) shapes[{p.rows(), p.cols()}] = true;
  std::vector<TuneRequest> out;
  for (const auto& [shape, _] : shapes) out.push_back({shape.first, shape.second, 1});
  return out;
}

const TuneEntry& tuned_entry(const Setup& s, int64_t rows, int64_t cols) {
  for (const auto& e : s.tuned)
    if (e.rows == rows && e.cols == cols) return e;
  DMUON_FAIL("bench: no tuned configuration for shape ", rows, "x", cols);
}

// Seeded synthetic gradients, different per parameter and step: xorshift64 mapped to [-1, 1).
void fill_gradient(std::span<float> g, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  for (float& v : g) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) * (1.0f / (1 << 23));
  }
}

// One backward's worth of gradients through the hooks (last unit first), reduced to the shards: made on the
// host and copied into the gradient buffers (backend memory).
void backward(shard::ShardedParams& sp, int step) {
  std::vector<float> g;
  for (int u = sp.num_units() - 1; u >= 0; --u) {
    sp.before_backward(u);
    for (int p : sp.layout(u).params) {
      const DeviceSpan<float> grad = sp.grad(p);
      g.resize(grad.size());
      fill_gradient(g, static_cast<uint64_t>(p) * 7919 + step);
      sp.backend().copy_from_host(grad.data(), g.data(), sizeof(float) * g.size());
    }
    sp.after_backward(u);
  }
  sp.finish_backward();
}

void max_over_ranks(comm::Comm& world, std::span<double> values) {
  world.all_reduce<double>(values, ReduceOp::max).wait();
}

// The variant's NS: the library's tuned Orthogonalizer (the ablations switch one tuned choice off), or fixed
// options; unbatched variants call it once per matrix.
Orthogonalizer make_orthogonalizer(const Setup& setup, const Variant& v) {
  const int threads = setup.threads.threads_per_rank;
  Orthogonalizer orth;
  if (setup.gpu) {  // untuned, in the device dtype; plain: the reference recurrence
    NsOptions o;
    o.dtype = setup.ns_dtype;
    if (o.dtype == DType::bf16) o.restarts = {1, 3};  // DESIGN 2.2: half precision
    if (v.engine == Engine::plain) {
      o.algo = NsAlgo::standard;
      o.symmetric = false;
    }
    orth = ns_orthogonalizer(o);
  } else {
    switch (v.engine) {
      case Engine::plain: {
        NsOptions o;
        o.algo = NsAlgo::standard;
        o.symmetric = false;
        o.threads = threads;
        orth = ns_orthogonalizer(o);
        break;
      }
      case Engine::untuned:
        orth = ns_orthogonalizer(untuned_options(threads));
        break;
      case Engine::tuned:
        orth = tuned_orthogonalizer(setup.tuned, untuned_options(threads));
        break;
      case Engine::tuned_gemm:
        orth = tuned_orthogonalizer(setup.tuned, untuned_options(threads), [](NsOptions& o) { o.symmetric = false; });
        break;
      case Engine::tuned_standard:
        orth = tuned_orthogonalizer(setup.tuned, untuned_options(threads),
                                    [](NsOptions& o) { o.algo = NsAlgo::standard; });
        break;
    }
  }
  if (v.batched) return orth;
  return [orth](Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
                std::span<const std::string> names, double* norms) {
    for (size_t i = 0; i < u.size(); ++i)
      orth(backend, u.subspan(i, 1), o.subspan(i, 1), names.empty() ? names : names.subspan(i, 1),
           norms ? norms + i : nullptr);
  };
}

// Round-robin owners over the setup's items.
Plan rr_plan(const Setup& s, int ranks) {
  const std::vector<int> rr = balance_rr(s.items, ranks);
  std::vector<int> rr_owners(s.params.size(), -1);
  for (size_t i = 0; i < s.items.size(); ++i) rr_owners[s.items[i].param] = rr[i];
  PlanOptions options;
  options.balancer = Balancer::rr;
  return plan_from_owners(s.params, s.items, ranks, rr_owners, options);
}

}  // namespace

ThreadPolicy thread_policy(int ranks) {
  ThreadPolicy p;
  p.cores = std::max(1u, std::thread::hardware_concurrency());
  p.threads_per_rank = std::max(1, p.cores / std::max(1, ranks));
  p.oversubscribed = ranks > p.cores;
  return p;
}

nlohmann::json run_context(const std::string& model, int ranks, const ThreadPolicy& threads, int steps) {
  return {{"model", model},
          {"ranks", ranks},
          {"cores", threads.cores},
          {"threads_per_rank", threads.threads_per_rank},
          {"oversubscribed", threads.oversubscribed},
          {"cpu", linalg::cpu_model()},
          {"blas", linalg::blas_description()},
          {"steps", steps}};
}

std::string run_line(const std::string& model, int ranks, const ThreadPolicy& threads) {
  return model + ", " + std::to_string(ranks) + " ranks, " + std::to_string(threads.threads_per_rank) +
         " BLAS thread(s) per rank on " + std::to_string(threads.cores) + " cores" +
         (threads.oversubscribed ? " (OVERSUBSCRIBED)" : "");
}

Setup prepare(comm::Comm& world, std::vector<ParamSpec> params, const std::string& tune_cache, Backend* gpu,
              DType ns_dtype) {
  Setup s;
  s.params = std::move(params);
  s.threads = thread_policy(world.size());
  s.tune_cache = tune_cache;
  s.gpu = gpu;
  s.ns_dtype = ns_dtype;
  const int threads = s.threads.threads_per_rank;
  linalg::set_threads(threads);
  const auto requests = shape_requests(s.params);
  DMUON_CHECK(!requests.empty(), "bench: the model has no Muon matrices");
  const int d = world.size();
  PlanOptions options;
  options.balancer = Balancer::milp;
  if (gpu) {  // nothing tuned on a GPU yet: owners balance flops
    s.items = make_plan_items(s.params, d, relative_flop_batch_time());
    s.milp = plan_across_ranks(world, s.params, s.items, options);
    s.rr = rr_plan(s, d);
    return s;
  }
  TuneSessionOptions tune;
  tune.cache_path = tune_cache;
  tune.threads = threads;
  size_t shown = SIZE_MAX;
  tune.progress = [&shown](size_t done, size_t total, const std::string&) {
    if (done != shown) std::fprintf(stderr, "tuning NS: %zu of %zu shapes done\n", done, total);
    shown = done;
  };
  tune.warn = [](const std::string& warning) { std::fprintf(stderr, "dmuon: warning: %s\n", warning.c_str()); };
  s.tuned = tune_across_ranks(world, requests, tune);

  // With threads_per_rank threads a batch runs its matrices one after another, so a batch costs the
  // count times the tuned single-matrix time.
  const BatchTimeFn batch_time = [&s](int64_t rows, int64_t cols, int batch) {
    return batch * tuned_entry(s, rows, cols).seconds;
  };
  s.items = make_plan_items(s.params, d, batch_time);
  s.milp = plan_across_ranks(world, s.params, s.items, options);
  s.rr = rr_plan(s, d);
  return s;
}

namespace {
// How the benchmarks run each optimizer the simulator compares (sim.hpp holds the list and the names).
Variant compared_variant(sim::ComparedOptimizer o) {
  using C = sim::ComparedOptimizer;
  switch (o) {
    case C::adamw: return {sim::to_string(o), OptimKind::adamw, Engine::tuned, true, {}};
    case C::muon_gather_plain: return {sim::to_string(o), OptimKind::muon_gather, Engine::plain, false, {}};
    case C::muon_gather: return {sim::to_string(o), OptimKind::muon_gather, Engine::tuned, true, {}};
    case C::dmuon: break;
  }
  return {sim::to_string(o), OptimKind::dmuon, Engine::tuned, true, {}};
}

const std::vector<Variant>& optimizers() {
  static const std::vector<Variant> table = [] {
    std::vector<Variant> out;
    for (sim::ComparedOptimizer o : sim::compared_optimizers()) out.push_back(compared_variant(o));
    return out;
  }();
  return table;
}
}  // namespace

const std::vector<std::string>& optimizer_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Variant& v : optimizers()) out.push_back(v.name);
    return out;
  }();
  return names;
}

const Variant& optimizer_spec(const std::string& name) {
  static const Variant single_process_muon{"muon", OptimKind::muon, Engine::tuned, true, {}};
  if (name == single_process_muon.name) return single_process_muon;
  std::string known;
  for (const Variant& v : optimizers()) {
    if (v.name == name) return v;
    known += (known.empty() ? "" : ", ") + v.name;
  }
  DMUON_FAIL("--optim: unknown optimizer '", name, "' (", known, ", or muon on one rank)");
}

Variant optimizer_variant(const Setup& setup, const std::string& name) {
  Variant v = optimizer_spec(name);
  if (v.kind == OptimKind::dmuon) v.owners = setup.milp.owner;
  return v;
}

namespace {

// A fresh world communicator for one runner: MPI, or NCCL over this rank's GPU.
std::shared_ptr<comm::Comm> runner_world(const Setup& setup) {
  if (!setup.gpu) return comm::world();
#ifdef DMUON_HAVE_NCCL
  return comm::nccl_world(comm::world(), *setup.gpu);
#else
  DMUON_FAIL("bench optimizer on ", setup.gpu->description(), ": this build of dmuon has no NCCL communicator");
#endif
}

// One variant's sharded parameters and optimizer, alive for the whole interleaved run.
struct Runner {
  std::shared_ptr<comm::Traffic> traffic = std::make_shared<comm::Traffic>();
  OptimizerStack stack;
  Measurement m;
  std::vector<double> blocked;
  std::vector<std::vector<double>> ns_s;  // per rank, per timed step
  OptimKind kind = OptimKind::dmuon;

  // Collective. Each runner talks on its own duplicate of the world communicator (on GPUs, a NCCL
  // communicator bootstrapped from one).
  Runner(const Setup& setup, const Variant& v) {
    auto comm = comm::counting(runner_world(setup), traffic);
    OptimizerStackOptions options;
    options.kind = v.kind;
    options.mode = shard::Mode::z2;
    if (v.kind != OptimKind::adamw) options.orth = make_orthogonalizer(setup, v);
    options.owners = v.owners;
    options.backend = setup.gpu;
    stack = make_optimizer_stack(comm, setup.params, options);
    if (v.kind == OptimKind::dmuon && !setup.gpu) {  // GPU plans balance relative flops, not seconds
      for (const RankPlan& r : plan_from_owners(setup.params, setup.items, comm->size(), v.owners, {}).per_rank)
        m.predicted_ns_s_per_rank.push_back(r.time_s);
    }
    m.name = v.name;
    kind = v.kind;
  }

  // Gradients through the hooks, then one timed step; `record` false for the warm-up.
  void step(comm::Comm& world, int s, bool record) {
    *traffic = {};
    backward(*stack.params, s);
    const double backward_sent = traffic->sent_bytes;
    std::vector<double> start = {0};
    max_over_ranks(world, start);  // start together
    *traffic = {};
    const auto t0 = Clock::now();
    stack.optimizer->step();
    stack.params->backend().synchronize();  // a device step ends when its queued work does
    std::vector<double> figures = {std::chrono::duration<double>(Clock::now() - t0).count(), traffic->blocked_s,
                                   traffic->sent_bytes, backward_sent};
    max_over_ranks(world, figures);
    std::vector<double> ns_mine = {stack.optimizer->last_stats().ns_s}, ns_all(world.size());
    world.all_gather<double>(ns_mine, ns_all).wait();
    if (!record) return;
    ns_s.resize(ns_all.size());
    for (size_t r = 0; r < ns_all.size(); ++r) ns_s[r].push_back(ns_all[r]);
    m.step_s.push_back(figures[0]);
    blocked.push_back(figures[1]);
    m.sent_bytes = figures[2];
    m.backward_sent_bytes = figures[3];
  }

  // The Measurement's memory figures (optim_bench.hpp), `before`: buffer_bytes().live before this runner was built.
  // Collective.
  void measure_memory(comm::Comm& world, const Setup& setup, const Variant& v, size_t before) {
    step(world, 0, false);
    const size_t held = buffer_bytes().live - before;
    std::vector<double> mine = {static_cast<double>(held), static_cast<double>(ns_workspace_bytes().live)};
    backward(*stack.params, 0);  // its unit gathers come and go before the step
    const size_t before_step = buffer_bytes(/*reset_peak=*/true).live;
    stack.optimizer->step();
    stack.params->backend().synchronize();
    mine.push_back(static_cast<double>(buffer_bytes().peak - before_step));
    std::vector<double> all(mine.size() * world.size());
    world.all_gather<double>(mine, all).wait();
    for (int r = 0; r < world.size(); ++r) {
      m.held_bytes_per_rank.push_back(all[3 * r]);
      m.ns_workspace_bytes_per_rank.push_back(all[3 * r + 1]);
      m.step_peak_bytes_per_rank.push_back(all[3 * r + 2]);
    }
    for (sim::ComparedOptimizer o : sim::compared_optimizers()) {
      if (sim::to_string(o) != v.name) continue;
      HardwareProfile engine;  // what the model needs of this run's engine: its Newton–Schulz buffers
      engine.ns_bytes_per_element = static_cast<double>(dtype_size(setup.gpu ? setup.ns_dtype : DType::f32));
      engine.batched_kernels = stack.params->backend().preferred_batch() > 1;
      const std::vector<int> owners = v.owners.empty() ? std::vector<int>(setup.params.size(), 0) : v.owners;
      for (const sim::RankMemory& r : sim::rank_memory(setup.params, owners, world.size(), o, engine))
        m.model_held_bytes_per_rank.push_back(r.held());
    }
  }

  Measurement finish(comm::Comm& world) {
    m.median_s = median(m.step_s);
    m.blocked_s = median(blocked);
    if (kind != OptimKind::adamw)
      for (const auto& per_step : ns_s) m.ns_s_per_rank.push_back(median(per_step));
    std::vector<double> sum_sq = {0};
    for (int u = 0; u < stack.params->num_units(); ++u) {
      for (float w : stack.params->shard_params(u).to_host()) sum_sq[0] += static_cast<double>(w) * w;
    }
    world.all_reduce<double>(sum_sq, ReduceOp::sum).wait();
    m.weight_norm = std::sqrt(sum_sq[0]);
    return m;
  }
};

}  // namespace

std::vector<Measurement> measure(const std::shared_ptr<comm::Comm>& world, const Setup& setup,
                                 const std::vector<Variant>& variants, int steps) {
  DMUON_CHECK(steps >= 1, "bench: --steps must be ≥ 1, got ", steps);
  std::vector<std::unique_ptr<Runner>> runners;
  for (const Variant& v : variants) {
    ns_release_workspaces();  // the workspaces this variant pools are its own
    const size_t before = buffer_bytes().live;
    runners.push_back(std::make_unique<Runner>(setup, v));
    runners.back()->measure_memory(*world, setup, v, before);
  }
  for (int s = 0; s <= steps; ++s)  // step 0 warms up (first touch of buffers and workspaces)
    for (auto& r : runners) r->step(*world, s, s > 0);
  std::vector<Measurement> out;
  for (auto& r : runners) out.push_back(r->finish(*world));
  return out;
}

}  // namespace dmuon::cli::optim_bench
