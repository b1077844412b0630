// Newton–Schulz orthogonalization (DESIGN.md section 2): the standard quintic recurrence and the
// Gram-space recurrence, on one matrix or a batch of same-shape matrices, on any Backend (DESIGN 6):
// row-major views, operands in float32 or (where the backend supports it) bfloat16 with float32
// accumulation. The optimizer calls only this header; the recurrences live in src/ns, the kernels in
// the backends (src/backend).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/backend_record.hpp"

namespace dmuon {

enum class NsAlgo {
  standard,   // X ← aX + (bA + cA²)X with A = XXᵀ (DESIGN 2.1)
  gram,       // the m×m Gram-space recurrence with restarts (DESIGN 2.2)
  automatic,  // gram when the aspect ratio makes it cheaper, else standard
};
enum class NsCoeffs { keller, you, polar_express };
enum class NsBatchMode {
  sequential,  // one queue: on the CPU one matrix after another, each BLAS call using all threads
  concurrent,  // matrices spread over `threads` queues (CPU: threads with single-threaded BLAS calls)
};

struct NsOptions {
  NsAlgo algo = NsAlgo::automatic;
  NsCoeffs coeffs = NsCoeffs::keller;
  int steps = 5;                     // any count; past the table's end the last row repeats
  double safety = 0.0;               // 0: the schedule's default (1 for keller/you, 1.01 polar-express)
  std::vector<int> restarts = {2};   // Gram restart steps (float32 default [2])
  bool symmetric = true;             // SYRK and upper-triangle products; false: plain sgemm everywhere
  int tiles = 8;                     // tiles per side of the upper-triangle products (8: DESIGN 5, 896-2048)
  NsBatchMode batch_mode = NsBatchMode::sequential;
  int threads = 0;                   // backend parallelism (CPU: BLAS threads) for this call; 0: the current
  DType dtype = DType::f32;          // storage of the iterates (bf16: GPU backends; accumulation stays float32)

  bool operator==(const NsOptions&) const = default;
};

// What a rows×cols call actually runs with: the algorithm resolved (ns_resolve_algo), the safety
// factor resolved (ns_default_safety), and the fields its path ignores reset (standard: restarts and
// tiles; plain sgemm, symmetric = false: tiles). Options with equal effective options run the same
// kernel: newton_schulz computes with these.
NsOptions ns_effective_options(const NsOptions& options, int64_t rows, int64_t cols);

// O_i = orth(U_i) for k same-shape rows×cols matrices on `backend` (float32 views, each contiguous;
// O_i may alias U_i). The batch runs as batched kernels of up to backend.preferred_batch() matrices on
// backend.parallelism()-wide queues (options.batch_mode, options.threads); every matrix's result is
// bit-identical to a batch of one. An all-zero U gives an all-zero O. Non-finite input: without `norms`
// the call reads the k input norms once and throws dmuon::Error naming the matrix (`names`, else
// "batch[i]"), the row and the column; with `norms` (k doubles in backend memory) it writes ‖U_i‖_F there
// and leaves the check to the caller, who reads them when it wants (the optimizer: once per step).
void newton_schulz_batched(Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
                           const NsOptions& options, std::span<const std::string> names = {},
                           double* norms = nullptr);

// Host-memory conveniences on cpu_backend(): O = orth(U) for one rows×cols matrix, and for k of them.
void newton_schulz(const float* u, float* o, int64_t rows, int64_t cols, const NsOptions& options,
                   const std::string& name = "matrix");
void newton_schulz_batched(std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
                           const NsOptions& options, std::span<const std::string> names = {});

// O_i = orth(U_i) for a batch of same-shape matrices on a backend (the Muon update's Newton–Schulz), with
// newton_schulz_batched's contract, `norms` included. A parameter, so tests can use a float64 reference,
// the autotuner its per-shape choice, and a backend its own kernels.
using Orthogonalizer = std::function<void(Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
                                          std::span<const std::string> names, double* norms)>;
// newton_schulz_batched with `options`.
Orthogonalizer ns_orthogonalizer(const NsOptions& options);

// The Newton–Schulz workspaces pooled for reuse (per backend, a few m×n and m×m buffers per queue) are
// kept up to this many bytes in all; more is freed when a call returns it, oldest first, except each
// backend's largest workspace, which stays whatever its size (so a batch larger than the limit reuses its
// memory and addresses on every call). Default 1 GiB, or DMUON_NS_WORKSPACE_MB. ns_release_workspaces() frees
// every pooled workspace now (e.g. after training), or only `backend`'s: call it before destroying a backend
// of your own that ran Newton–Schulz.
void ns_set_workspace_limit(size_t bytes);
void ns_release_workspaces(const Backend* backend = nullptr);
size_t ns_pooled_workspace_bytes();
// Every Newton–Schulz workspace's bytes now, pooled and leased, on every backend (device memory included), and the
// most they came to since the last reset (reset_peak: from now on, peak starts at live): of buffer_bytes(), the part
// Newton–Schulz keeps, for the benchmarks' memory figures. Counted where the workspaces' buffers are allocated and
// freed.
MemoryCount ns_workspace_bytes(bool reset_peak = false);

// One row of a coefficient schedule: p(x) = a·x + b·x³ + c·x⁵.
struct NsStep {
  double a, b, c;
};

// The safety factor a schedule uses when NsOptions::safety is 0: 1 for keller and you, 1.01 for
// polar-express (the paper's value).
double ns_default_safety(NsCoeffs coeffs);

// The `steps` rows a run uses (DESIGN 2.4): past the end of the table the last row repeats; a safety
// factor s maps (a,b,c) to (a/s, b/s³, c/s⁵) (for polar-express every row except its final, converged
// one (1.875, −1.25, 0.375), as in the paper's code). s ≤ 0 means the schedule's default.
std::vector<NsStep> ns_schedule(NsCoeffs coeffs, int steps, double safety = 0.0);

// The algorithm `automatic` picks for a rows×cols matrix: gram when max/min ≥ 2. DESIGN 2.3's cost
// table gives gram 26 vs 35 m³ (standard with SYRK) at aspect 2 and equal flops at 1, where gram's
// triangle products run slower (DESIGN 5: 0.82–0.84× vs 0.71× of the plain path on squares).
// standard and gram are returned unchanged.
NsAlgo ns_resolve_algo(NsAlgo algo, int64_t rows, int64_t cols);

// Names as the CLI spells them ("standard", "gram", "auto"; "keller", "you", "polar-express";
// "sequential", "concurrent"); parse_* throw dmuon::Error listing the valid names.
std::string to_string(NsAlgo algo);
std::string to_string(NsCoeffs coeffs);
std::string to_string(NsBatchMode mode);
NsAlgo parse_ns_algo(const std::string& name);
NsCoeffs parse_ns_coeffs(const std::string& name);
NsBatchMode parse_ns_batch_mode(const std::string& name);
// Restart steps from a comma-separated list ("2", "1,3"; "" or "none": no restarts).
std::vector<int> parse_ns_restarts(const std::string& list);

// Flops of the plain standard recurrence (full GEMMs): steps·(4m²n + 2m³), m = min, n = max dim.
double standard_ns_flops(int64_t rows, int64_t cols, int steps);

// The kernels newton_schulz_batched issues for `batch` rows×cols matrices with `options` on a backend that
// batches `preferred_batch` matrices per call (the real engine, run on a RecordingBackend), with the input
// norms left on the device as the optimizer's step leaves them.
std::vector<KernelCall> ns_kernel_calls(int64_t rows, int64_t cols, int batch, const NsOptions& options,
                                        int64_t preferred_batch = 1);

// Σ flops of calls (executed flops; full_flops = false) or of the same products done as full gemms.
double total_flops(const std::vector<KernelCall>& calls, bool full = false);

}  // namespace dmuon
