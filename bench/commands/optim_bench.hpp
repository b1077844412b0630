// The optimizer-step harness shared by `dmuon bench optimizer` and `dmuon bench ablation` (under mpirun):
// a model's real parameter shapes (models/*.json), synthetic seeded gradients reduced through the
// sharded-parameter hooks, and one optimizer variant at a time timed side by side in one process.
//
// Per step the time is the slowest rank's (max over ranks); a variant's figure is the median over the
// timed steps (after one untimed warm-up step); variants measured together run interleaved. Traffic is counted by
// comm::counting (see comm.hpp for exactly what "sent bytes" and "blocked" mean).
//
// On GPUs (Setup::gpu) the same variants run with parameters, gradients and optimizer state on each rank's own
// GPU and NCCL between ranks (comm_nccl.hpp), built by the same factory; Newton–Schulz runs untuned in the
// device dtype (bf16: Gram restarts [1, 3]), owners are planned from relative flop counts, and a step's time
// includes waiting for its device work.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dmuon/comm.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/optimizer_factory.hpp"
#include "dmuon/params.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/tune.hpp"

namespace dmuon::cli::optim_bench {

// BLAS threads per rank: the cores shared evenly, one per rank when ranks ≥ cores.
struct ThreadPolicy {
  int cores = 1;
  int threads_per_rank = 1;
  bool oversubscribed = false;  // more ranks than cores
};
ThreadPolicy thread_policy(int ranks);

// What every variant of one benchmark run shares: the model, the tuned NS configurations (one per
// Muon shape, tuned by rank 0 at batch 1 with threads_per_rank threads, cached) and the owner plans.
struct Setup {
  std::vector<ParamSpec> params;
  ThreadPolicy threads;
  std::vector<TuneEntry> tuned;  // per Muon shape (batch 1)
  std::vector<PlanItem> items;   // costs from `tuned`
  Plan milp;                     // solved by rank 0, broadcast
  Plan rr;                       // round-robin over the same items
  std::string tune_cache;
  Backend* gpu = nullptr;          // this rank's GPU (null: the CPU, MPI between ranks)
  DType ns_dtype = DType::f32;     // Newton–Schulz iterates on the GPU
};

// Collective. Rank 0 tunes what the cache lacks (and saves it), solves the MILP plan and broadcasts
// the owners; every rank then reads the cache. With `gpu` (this rank's GPU backend: rank_device) nothing is
// tuned and the plan's costs are relative flop counts.
Setup prepare(comm::Comm& world, std::vector<ParamSpec> params, const std::string& tune_cache, Backend* gpu = nullptr,
              DType ns_dtype = DType::f32);

// How NS runs in a variant.
enum class Engine {
  plain,           // the public reference: standard recurrence, plain sgemm (NsOptions{standard, symmetric=false})
  tuned,           // the tuned configuration of each shape
  untuned,         // tune.hpp's untuned_options (NsOptions defaults)
  tuned_gemm,      // tuned, with symmetric products turned off
  tuned_standard,  // tuned, with the standard recurrence instead of Gram space
};

struct Variant {
  std::string name;
  OptimKind kind = OptimKind::dmuon;  // adamw, muon_gather or dmuon (optimizer_factory.hpp)
  Engine engine = Engine::tuned;
  bool batched = true;      // false: one matrix per NS call
  std::vector<int> owners;  // dmuon: per parameter (from a Plan)
};

struct Measurement {
  std::string name;
  std::vector<double> step_s;  // per timed step: the slowest rank's time
  double median_s = 0;
  double sent_bytes = 0;           // per step, in the optimizer step, max over ranks
  double blocked_s = 0;            // median over steps of the max over ranks: exposed communication
  double backward_sent_bytes = 0;  // the gradient reduce before each step (max over ranks)
  double weight_norm = 0;          // ‖all weights‖_F after the last step (equal across Muon variants)
  // Muon variants, per rank: its NS seconds in the step (Optimizer::last_stats, median over steps) and,
  // with owners, the plan's predicted NS load for them (per_rank time_s from the tuned costs).
  std::vector<double> ns_s_per_rank;
  std::vector<double> predicted_ns_s_per_rank;
  // Memory per rank in bytes, counted (buffer_bytes: every Buffer the variant allocates), before its timed steps, the
  // variant alone: what it holds once its first step has run (sharded parameters and gradients, optimizer state, the
  // step's kept buffers, the Newton–Schulz workspace it pooled), of which that workspace, and what a second step
  // allocates above that at its peak; beside them the simulator's model of the held bytes (sim::rank_memory; empty
  // for single-process muon).
  std::vector<double> held_bytes_per_rank, ns_workspace_bytes_per_rank, step_peak_bytes_per_rank;
  std::vector<double> model_held_bytes_per_rank;
};

// The names of the optimizers every benchmark compares (bench optimizer, ablation and e2e, and the report's tables,
// in this order): sim.hpp's compared_optimizers: adamw, muon-gather-plain (the paper's baseline: gather-then-compute,
// plain NS, one matrix per call), muon-gather (the same with the tuned batched engine), dmuon (MILP owners, tuned).
const std::vector<std::string>& optimizer_names();
// How `name` runs, without owners: one of optimizer_names() or "muon" (single-process Muon, a world of one);
// throws "--optim: unknown optimizer ..." naming the known ones.
const Variant& optimizer_spec(const std::string& name);
// The same with dmuon's owners from setup.milp.
Variant optimizer_variant(const Setup& setup, const std::string& name);

// Collective: runs `steps` timed steps (plus one warm-up) of every variant, interleaved — step s of each
// variant in turn, all variants alive at once — so that load changes on a shared machine reach every
// variant alike. Memory: the sum of the variants'. Before that, each variant as it is built runs two untimed steps
// alone, the Measurement's memory figures (the pooled Newton–Schulz workspaces are emptied before each, so that each
// variant counts its own).
std::vector<Measurement> measure(const std::shared_ptr<comm::Comm>& world, const Setup& setup,
                                 const std::vector<Variant>& variants, int steps);

// The run's context for JSON output: model label, ranks, cores, threads per rank, oversubscription, CPU,
// BLAS, timed steps.
nlohmann::json run_context(const std::string& model, int ranks, const ThreadPolicy& threads, int steps);
// The same as one line for tables: "<model>, <ranks> ranks, <t> BLAS thread(s) per rank on <c> cores".
std::string run_line(const std::string& model, int ranks, const ThreadPolicy& threads);

}  // namespace dmuon::cli::optim_bench
