// Newton–Schulz orthogonalization (DESIGN.md section 2): the standard quintic recurrence and the
// Gram-space recurrence, on one matrix or a batch of same-shape matrices. float32, host memory,
// row-major. The optimizer calls only this header; kernels live in src/ns and src/linalg.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace dmuon {

enum class NsAlgo {
  standard,   // X ← aX + (bA + cA²)X with A = XXᵀ (DESIGN 2.1)
  gram,       // the m×m Gram-space recurrence with restarts (DESIGN 2.2)
  automatic,  // gram when the aspect ratio makes it cheaper, else standard
};
enum class NsCoeffs { keller, you, polar_express };
enum class NsBatchMode {
  sequential,  // one matrix after another, each BLAS call using all configured threads
  concurrent,  // matrices spread over threads, each BLAS call single-threaded
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
  int threads = 0;                   // BLAS threads for this call; 0: the current setting

  bool operator==(const NsOptions&) const = default;
};

// What a rows×cols call actually runs with: the algorithm resolved (ns_resolve_algo), the safety
// factor resolved (ns_default_safety), and the fields its path ignores reset (standard: restarts and
// tiles; plain sgemm, symmetric = false: tiles). Options with equal effective options run the same
// kernel: newton_schulz computes with these.
NsOptions ns_effective_options(const NsOptions& options, int64_t rows, int64_t cols);

// O = orth(U). U and O are rows×cols, row-major, and may alias. `name` appears in errors
// (NaN/Inf input is an error; an all-zero U gives an all-zero O).
void newton_schulz(const float* u, float* o, int64_t rows, int64_t cols, const NsOptions& options,
                   const std::string& name = "matrix");

// The same for k same-shape matrices. Results are bit-identical to k calls of newton_schulz.
void newton_schulz_batched(std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
                           const NsOptions& options, std::span<const std::string> names = {});

// O_i = orth(U_i) for a batch of same-shape rows×cols matrices (the Muon update's Newton–Schulz).
// A parameter, so tests can use a float64 reference and another backend its own kernels.
using Orthogonalizer = std::function<void(std::span<const float* const> u, std::span<float* const> o,
                                          int64_t rows, int64_t cols, std::span<const std::string> names)>;
// newton_schulz_batched with `options`.
Orthogonalizer ns_orthogonalizer(const NsOptions& options);

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

}  // namespace dmuon
