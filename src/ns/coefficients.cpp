// Coefficient schedules (DESIGN 2.4), algorithm choice and the names the CLI uses.
#include <algorithm>
#include <cmath>

#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"
#include "io/enum_names.hpp"

namespace dmuon {

namespace {

const std::vector<NsStep> kKeller = {{3.4445, -4.7750, 2.0315}};

const std::vector<NsStep> kYou = {
    {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
    {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
};

// Amsel et al., "The Polar Express" (arXiv 2505.16932), degree 5, ℓ = 1e-3: the full published table. Its
// last row is the converged Newton–Schulz polynomial; later steps repeat it.
const std::vector<NsStep> kPolarExpress = {
    {8.28721201814563, -23.595886519098837, 17.300387312530933},
    {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
    {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
    {3.3184196573706015, -2.488488024314874, 0.51004894012372},
    {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
    {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
    {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
    {1.875, -1.25, 0.375},
};

const std::vector<NsStep>& table(NsCoeffs coeffs) {
  switch (coeffs) {
    case NsCoeffs::keller:
      return kKeller;
    case NsCoeffs::you:
      return kYou;
    case NsCoeffs::polar_express:
      return kPolarExpress;
  }
  DMUON_FAIL("unknown coefficient schedule ", static_cast<int>(coeffs));
}

}  // namespace

double ns_default_safety(NsCoeffs coeffs) { return coeffs == NsCoeffs::polar_express ? 1.01 : 1.0; }

std::vector<NsStep> ns_schedule(NsCoeffs coeffs, int steps, double safety) {
  DMUON_CHECK(steps >= 0, "Newton-Schulz step count must be non-negative, got ", steps);
  DMUON_CHECK(std::isfinite(safety), "Newton-Schulz safety factor must be finite, got ", safety);
  const double s = safety > 0 ? safety : ns_default_safety(coeffs);
  const auto& rows = table(coeffs);
  // polar-express leaves its converged last row unscaled (the paper's code); the single-row keller table has
  // no such row, so every one of its steps is scaled.
  const size_t scaled_rows = coeffs == NsCoeffs::polar_express ? rows.size() - 1 : rows.size();
  std::vector<NsStep> out;
  for (int t = 0; t < steps; ++t) {
    const size_t i = std::min<size_t>(t, rows.size() - 1);
    NsStep r = rows[i];
    if (i < scaled_rows) r = {r.a / s, r.b / (s * s * s), r.c / (s * s * s * s * s)};
    out.push_back(r);
  }
  return out;
}

NsAlgo ns_resolve_algo(NsAlgo algo, int64_t rows, int64_t cols) {
  if (algo != NsAlgo::automatic) return algo;
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  return n >= 2 * m ? NsAlgo::gram : NsAlgo::standard;
}

namespace {
constexpr EnumName<NsAlgo> kAlgoNames[] = {
    {NsAlgo::standard, "standard"}, {NsAlgo::gram, "gram"}, {NsAlgo::automatic, "auto"}};
constexpr EnumName<NsCoeffs> kCoeffsNames[] = {
    {NsCoeffs::keller, "keller"}, {NsCoeffs::you, "you"}, {NsCoeffs::polar_express, "polar-express"}};
constexpr EnumName<NsBatchMode> kBatchModeNames[] = {
    {NsBatchMode::sequential, "sequential"}, {NsBatchMode::concurrent, "concurrent"}};
}  // namespace

std::string to_string(NsAlgo algo) { return std::string(name_of(kAlgoNames, algo)); }
std::string to_string(NsCoeffs coeffs) { return std::string(name_of(kCoeffsNames, coeffs)); }
std::string to_string(NsBatchMode mode) { return std::string(name_of(kBatchModeNames, mode)); }

NsAlgo parse_ns_algo(const std::string& name) { return parse_name(kAlgoNames, "Newton-Schulz algorithm", name); }
NsCoeffs parse_ns_coeffs(const std::string& name) {
  return parse_name(kCoeffsNames, "Newton-Schulz coefficient schedule", name);
}
NsBatchMode parse_ns_batch_mode(const std::string& name) { return parse_name(kBatchModeNames, "batch mode", name); }

std::vector<int> parse_ns_restarts(const std::string& list) {
  std::vector<int> steps;
  if (list.empty() || list == "none") return steps;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, end - start);
    size_t used = 0;
    int value = -1;
    try {
      value = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DMUON_CHECK(used == item.size() && !item.empty() && value >= 0, "Newton-Schulz restarts: '", item, "' in '", list,
                "' is not a non-negative step number");
    steps.push_back(value);
    start = end + 1;
  }
  return steps;
}

}  // namespace dmuon
