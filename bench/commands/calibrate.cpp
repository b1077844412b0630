// `dmuon bench calibrate` (under mpirun): measures this machine as the cluster simulator sees a device
// (include/dmuon/hardware_profile.hpp's HardwareProfile) and writes a hardware profile, `this-cpu`, whose every
// number says how it was measured. Every rank measures at once, with the thread policy of the optimizer
// benchmarks (optim_bench.hpp), so the figures include the contention a rank sees in `bench optimizer`;
// the slowest rank's figure is kept. The profile records the cores and ranks it was measured with, so the
// simulator rescales it for other rank counts (sim::at_devices).
//   ns_flops, peak_flops: sgemm 1024³ flop rate per rank (best of 5 after a warm-up call), or plain NS's
//     rate below when that is higher (all ranks busy at once: the small sgemm can read low)
//   ns_efficiency: Σ plain-NS flops / Σ plain-NS time / ns_flops over the model's Muon shapes (the
//     public reference recurrence, the sim's `plain` engine)
//   syrk_speedup, sym_gemm_speedup: over the model's Muon shapes (m ≤ n), Σ time of the full sgemm /
//     Σ time of the symmetric kernel computing the same product: X·Xᵀ (m×n) and S·S (m×m) by SYRK, and
//     the upper-triangle product of two m×m factors (NsOptions' default tiles)
//   mfu: forward+backward of the GPT demo model (`bench e2e --config demo`'s shapes and per-rank batch,
//     16/ranks sequences) on every rank: 3·gpt_forward_flops / time / peak_flops
//   single_rank_speedup: rank 0 alone with every core on the whole batch (bench e2e at np 1) over that rate;
//     single_rank_ns_speedup the same for the 1024³ sgemm (NS products scale with threads better than the GPT)
//   hbm_bytes_per_s: AdamW over a rank's share of the model's elements (≤ 64 M), 7 float32 streams
//   intra/inter-node bytes/s: ring all-gather of 16 MiB: (p−1)/p · bytes / time (one machine: both the same)
//   latencies: all-reduce of one double / (2⌈log2 p⌉) steps (the sim's tree all-reduce)
//   kernel_launch_s: plain NS on 16×16 / the kernels the sim counts for it
// Default output: models/hardware/this-cpu.json beside the executable (build/), which
// `dmuon simulate --profile this-cpu` finds.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/atomic_file.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/gpt.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/sim.hpp"
#include "cli_kit/e2e_configs.hpp"
#include "cli_kit/model_args.hpp"
#include "optim_bench.hpp"

namespace dmuon::cli {

namespace calibrate {

using Clock = std::chrono::steady_clock;

struct Args {
  ModelArgs model;
  std::string out;
};

template <typename Fn>
double best_of(int reps, Fn&& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

std::string default_out() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  const auto dir = ec ? std::filesystem::path(".") : exe.parent_path();
  return (dir / "models" / "hardware" / "this-cpu.json").string();
}

void run(const Args& a) {
  auto world = comm::world();
  const int p = world->size();
  const auto policy = optim_bench::thread_policy(p);
  linalg::set_threads(policy.threads_per_rank);
  auto slowest = [&](double seconds) {
    world->all_reduce<double>(std::span<double>(&seconds, 1), ReduceOp::max).wait();
    return seconds;
  };
  auto sync = [&] { slowest(0); };

  // sgemm rate.
  const int64_t n = 1024;
  std::vector<float> A(n * n, 0.5f), B(n * n, 0.25f), C(n * n);
  const auto sgemm = [&] { linalg::gemm(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n); };
  sgemm();  // warm-up: BLAS thread start and first touch of C
  sync();
  const double gemm_s = slowest(best_of(5, sgemm));
  const double sgemm_flops = 2.0 * n * n * n / gemm_s;

  // Plain NS over the model's Muon shapes.
  std::map<std::pair<int64_t, int64_t>, int> shapes;
  int64_t model_elements = 0;
  for (const auto& s : a.model.load()) {
    model_elements += s.numel();
    if (s.role == ParamRole::matrix) ++shapes[{s.rows(), s.cols()}];
  }
  NsOptions plain;
  plain.algo = NsAlgo::standard;
  plain.symmetric = false;
  double ns_flops = 0, ns_s = 0;
  for (const auto& [shape, count] : shapes) {
    std::vector<float> u(shape.first * shape.second), o(u.size());
    for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    sync();
    const double t = slowest(best_of(2, [&] { newton_schulz(u.data(), o.data(), shape.first, shape.second, plain); }));
    ns_flops += count * standard_ns_flops(shape.first, shape.second, 5);
    ns_s += count * t;
  }
  // The peak is the faster of the two: with every rank busy at once a 1024³ sgemm can read slower than the
  // model's NS shapes, and an efficiency above 1 would be capped away, understating NS.
  const double flops = std::max(sgemm_flops, ns_flops / ns_s);
  const double efficiency = ns_flops / ns_s / flops;

  // Symmetric products against the full sgemm of the same product, at the model's shapes.
  double full_syrk_s = 0, syrk_s = 0, full_sym_s = 0, sym_s = 0;
  const int tiles = NsOptions{}.tiles;
  for (const auto& [shape, count] : shapes) {
    const int64_t m = std::min(shape.first, shape.second), k = std::max(shape.first, shape.second);
    std::vector<float> x(m * k), c(m * m), s1(m * m), s2(m * m);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) s1[i * m + j] = s2[j * m + i] = x[std::min(i, j) * k + std::max(i, j)];
    auto timed = [&](auto&& fn) {
      sync();
      return count * slowest(best_of(2, fn));
    };
    full_syrk_s += timed([&] { linalg::gemm(false, true, m, m, k, 1.0f, x.data(), k, x.data(), k, 0.0f, c.data(), m); });
    syrk_s += timed([&] { linalg::syrk(m, k, 1.0f, x.data(), k, 0.0f, c.data(), m); });
    const double square_full =
        timed([&] { linalg::gemm(false, false, m, m, m, 1.0f, s1.data(), m, s1.data(), m, 0.0f, c.data(), m); });
    full_syrk_s += square_full;
    syrk_s += timed([&] { linalg::syrk(m, m, 1.0f, s1.data(), m, 0.0f, c.data(), m); });
    full_sym_s += square_full;
    sym_s += timed([&] {
      linalg::symmetric_gemm(m, m, 1.0f, s1.data(), m, s2.data(), m, 0.0f, c.data(), m, tiles);
    });
  }

  // Forward and backward of the GPT demo model, each rank on its share of bench e2e's batch.
  const E2eConfig demo = e2e_config("demo");
  const GptConfig& gpt = demo.model;
  const int64_t full_batch = demo.batch;  // bench e2e's batch at np 1
  Gpt model(gpt);
  GptBuffers buffers(model);
  buffers.init(gpt, model.params(), 1);
  buffers.bind_to(model);
  const int64_t batch = std::max<int64_t>(1, full_batch / p), T = gpt.context;
  std::vector<int32_t> tokens(full_batch * (T + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 2654435761u) % gpt.vocab);
  std::vector<int32_t> inputs, targets;  // (full_batch, T)
  for (int64_t b = 0; b < full_batch; ++b) {
    inputs.insert(inputs.end(), tokens.begin() + b * (T + 1), tokens.begin() + b * (T + 1) + T);
    targets.insert(targets.end(), tokens.begin() + b * (T + 1) + 1, tokens.begin() + (b + 1) * (T + 1));
  }
  auto fwd_bwd_of = [&](int64_t sequences) {
    return [&, sequences] {
      buffers.zero_grads();
      model.forward(inputs.data(), targets.data(), sequences, T);
      model.backward();
    };
  };
  fwd_bwd_of(batch)();  // warm-up: first-touch of the activations
  sync();
  const double fwd_bwd_s = slowest(best_of(3, fwd_bwd_of(batch)));
  const double fwd_bwd_rate = 3 * gpt_forward_flops(gpt, T) * batch / fwd_bwd_s;
  const double mfu = std::min(1.0, fwd_bwd_rate / flops);
  // One rank alone with every core (bench e2e at np 1: the whole batch, cores BLAS threads) against a rank
  // of this run: how much a rank gains from the cores the others leave idle (small GEMMs and the
  // single-threaded layers gain far less than cores/ranks).
  // The same for NS-sized products: the 1024³ sgemm alone with every core against a rank's rate above.
  double single_rank_speedup = 1, single_rank_ns_speedup = 1;
  if (p > 1) {
    double alone_s = 0, sgemm_alone_s = 0;
    if (world->rank() == 0) {
      linalg::ThreadsScope all_cores(policy.cores);
      fwd_bwd_of(full_batch)();
      alone_s = best_of(3, fwd_bwd_of(full_batch));
      sgemm();
      sgemm_alone_s = best_of(5, sgemm);
    } else {
      // Waiting inside a collective polls a core: sleep through rank 0's work (three times its estimate,
      // from this rank's own times) so that rank 0 really is alone.
      const double estimate = 4 * fwd_bwd_s * static_cast<double>(full_batch) / batch + 6 * gemm_s;
      std::this_thread::sleep_for(std::chrono::duration<double>(3 * estimate));
    }
    single_rank_speedup = 3 * gpt_forward_flops(gpt, T) * full_batch / slowest(alone_s) / fwd_bwd_rate;
    single_rank_ns_speedup = gemm_s / slowest(sgemm_alone_s);
  }

  // AdamW streams over a rank's share of the model (at most 64 M elements, 1 GiB of state): on this machine the
  // rate depends on the buffer size (8 M elements read about half the rate of 64 M), so measure at the size used.
  const int64_t elements = std::clamp<int64_t>(model_elements / p, 1 << 20, 64 << 20);
  std::vector<float> w(elements, 0.1f), g(elements, 0.01f), m(elements), v(elements);
  AdamWHyper hyper;
  int64_t t = 0;
  sync();
  const double adamw_s = slowest(best_of(5, [&] { adamw_step(w, g, 1.0f, m, v, ++t, hyper); }));
  const double hbm = 7.0 * 4 * elements / adamw_s;

  // Tiny NS: per-call overhead.
  std::vector<float> tiny(16 * 16, 0.1f), tiny_o(tiny.size());
  for (int i = 0; i < 16; ++i) tiny[i * 17] = 1.0f;
  const int tiny_kernels = sim::ns_cost(16, 16, 1, sim::NsEngine::plain, HardwareProfile{}).kernels;
  const double launch =
      slowest(best_of(20, [&] { newton_schulz(tiny.data(), tiny_o.data(), 16, 16, plain); })) / tiny_kernels;

  // Communication (one machine: a single link).
  double link = 0, latency = 0;
  if (p > 1) {
    const int64_t per_rank = (16 << 20) / 4 / p;
    std::vector<float> send(per_rank, 1.0f), recv(per_rank * p);
    world->all_gather<float>(send, recv).wait();
    sync();
    const double ag = slowest(best_of(5, [&] { world->all_gather<float>(send, recv).wait(); }));
    link = (p - 1.0) / p * (16 << 20) / ag;
    double x = 1;
    sync();
    const double ar =
        slowest(best_of(50, [&] { world->all_reduce<double>(std::span<double>(&x, 1), ReduceOp::sum).wait(); }));
    latency = ar / (2.0 * std::ceil(std::log2(static_cast<double>(p))));
  }
  if (world->rank() != 0) return;
  if (p == 1) {  // nothing to measure; any positive figure (collectives over one rank cost 0 in the sim)
    link = 1e10;
    latency = 1e-6;
  }
  const std::string how = "MEASURED by `mpirun -np " + std::to_string(p) + " dmuon bench calibrate --model " +
                          a.model.label() + "` on " + linalg::cpu_model() + ", " +
                          std::to_string(policy.threads_per_rank) +
                          " BLAS thread(s) per rank, all ranks at once, slowest rank: ";
  nlohmann::json j = {
      {"name", "this-cpu"},
      {"description", "one MPI rank of this machine (" + linalg::cpu_model() + ", " + std::to_string(policy.cores) +
                          " cores) at " + std::to_string(p) + " ranks, float32"},
      {"peak_flops", flops},
      {"mfu", mfu},
      {"ns_flops", flops},
      {"ns_efficiency", efficiency},
      {"hbm_bytes_per_s", hbm},
      {"intra_node_bytes_per_s", link},
      {"inter_node_bytes_per_s", link},
      {"intra_node_latency_s", latency},
      {"inter_node_latency_s", latency},
      {"kernel_launch_s", launch},
      {"sm_count", 1},
      {"comm_bytes_per_element", 4},
      {"syrk_speedup", full_syrk_s / syrk_s},
      {"sym_gemm_speedup", full_sym_s / sym_s},
      {"ns_bytes_per_element", 4},
      {"batched_kernels", false},
      {"shared_cores", policy.cores},
      {"calibration_ranks", p},
      {"single_rank_speedup", single_rank_speedup},
      {"single_rank_ns_speedup", single_rank_ns_speedup},
      {"sources",
       {{"peak_flops", how + "the larger of sgemm 1024^3 (best of 5 after a warm-up call: " +
                          std::to_string(sgemm_flops / 1e9) + " GFLOP/s) and plain NS's rate on the model's shapes"},
        {"ns_flops", "the same as peak_flops"},
        {"ns_efficiency", how + "plain standard NS (full sgemm) on the model's Muon shapes: flops / time / ns_flops"},
        {"mfu", how + "forward+backward of the GPT demo model (L4 C128 NH4 T64) on " + std::to_string(batch) +
                    " sequences per rank (bench e2e's batch at this rank count): 3*gpt_forward_flops / time / "
                    "peak_flops, best of 3"},
        {"syrk_speedup", how + "over the model's Muon shapes, sum of sgemm times / sum of ssyrk times for X*X^T "
                             "(m x n) and S*S (m x m), best of 2 each"},
        {"sym_gemm_speedup", how + "over the model's Muon shapes, sum of sgemm times / sum of upper-triangle "
                                 "product times (" + std::to_string(tiles) + " tiles) for m x m factors, best of 2 each"},
        {"ns_bytes_per_element", "float32 Newton-Schulz on the CPU"},
        {"batched_kernels", "the CPU runs a batch matrix by matrix (newton_schulz_batched): one call per matrix"},
        {"shared_cores", "the cores of this machine, which every rank shares (the simulator rescales rates for "
                         "other rank counts)"},
        {"calibration_ranks", "ranks measuring at once in this run"},
        {"single_rank_speedup",
         p > 1 ? how.substr(0, how.find(", all ranks")) + ": rank 0 alone with " + std::to_string(policy.cores) +
                     " BLAS threads on the GPT demo's forward+backward of " + std::to_string(full_batch) +
                     " sequences, its flop rate / a rank's rate above (mfu); the simulator's BLAS rate at 1 rank"
               : "1 rank: measured alone already"},
        {"single_rank_ns_speedup",
         p > 1 ? how.substr(0, how.find(", all ranks")) + ": rank 0 alone with " + std::to_string(policy.cores) +
                     " BLAS threads on sgemm 1024^3 (best of 5), over a rank's sgemm time above; the simulator's "
                     "NS rate at 1 rank"
               : "1 rank: measured alone already"},
        {"hbm_bytes_per_s", how + "AdamW step over " + std::to_string(elements) +
                                " elements (a rank's share of the model, at most 64M), 7 float32 streams, best of 5"},
        {"intra_node_bytes_per_s", p > 1 ? how + "ring all-gather of 16 MiB, (p-1)/p*bytes/time" : "1 rank: unused"},
        {"inter_node_bytes_per_s", "one machine: the intra-node figure"},
        {"intra_node_latency_s", p > 1 ? how + "all-reduce of 8 bytes / (2 ceil(log2 p)) tree steps" : "1 rank: unused"},
        {"inter_node_latency_s", "one machine: the intra-node figure"},
        {"kernel_launch_s", how + "plain NS on 16x16 / the " + std::to_string(tiny_kernels) +
                                " calls (products and passes) the simulator counts for it"},
        {"sm_count", "a CPU rank: no SM occupancy limit (1)"},
        {"comm_bytes_per_element", "float32 gathers and reductions, as dmuon runs on CPU"}}}};
  const std::string out = a.out.empty() ? default_out() : a.out;
  std::filesystem::create_directories(std::filesystem::path(out).parent_path());
  write_file_atomically(out, j.dump(2) + "\n");
  std::printf("%s\nwritten to %s\n", j.dump(2).c_str(), out.c_str());
}

Registration reg("", [](CLI::App& bench) {
  auto args = std::make_shared<Args>();
  auto* c = bench.add_subcommand("calibrate",
                                 "Measure this machine as a simulator hardware profile (this-cpu; run "
                                 "under mpirun)");
  args->model.add_to(c);
  c->add_option("--out", args->out, "Profile file (default: models/hardware/this-cpu.json beside the executable)");
  c->callback([args] { run(*args); });
});

}  // namespace calibrate

}  // namespace dmuon::cli
