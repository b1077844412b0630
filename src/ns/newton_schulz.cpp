// Newton–Schulz on a chunk of same-shape matrices (DESIGN 2.1, 2.2): normalisation and input checks, the
// standard recurrence and the Gram-space recurrence as batched backend kernels, and the option checks.
#include <algorithm>
#include <bit>
#include <cmath>
#include <utility>

#include "dmuon/error.hpp"
#include "ns/workspace.hpp"

namespace dmuon {
namespace ns_detail {

void check_options(const NsOptions& options, const Backend& backend) {
  DMUON_CHECK(options.steps >= 0, "Newton-Schulz steps must be non-negative, got ", options.steps);
  DMUON_CHECK(options.tiles >= 1, "Newton-Schulz tiles must be at least 1, got ", options.tiles);
  DMUON_CHECK(std::isfinite(options.safety) && options.safety >= 0,
              "Newton-Schulz safety must be finite and non-negative (0: the "
              "schedule's default), got ",
              options.safety);
  for (int r : options.restarts) DMUON_CHECK(r >= 0, "Newton-Schulz restart steps must be non-negative, got ", r);
  DMUON_CHECK(backend.supports(options.dtype), "Newton-Schulz in ", to_string(options.dtype), " is not supported by ",
              to_string(backend.device()), " (", backend.description(), ")");
}

namespace {

// The products of the recurrences on X (m×n, m ≤ n), for every matrix of a chunk at once, as SYRK /
// upper-triangle gemm, or full gemm when options.symmetric is false (the cost of the public reference code). A
// tall input U (n×m) is used in place as X = Uᵀ through transpose flags, so it is never transposed in memory.
struct Products {
  Backend& be;
  int64_t m, n;
  bool tall;  // X is stored as Xᵀ (n×m row-major)
  bool symmetric;
  int tiles;

  // C(m×m) = alpha·X·Xᵀ + beta·C.
  void gram(float alpha, const MatView& x, float beta, const MatView& c) const {
    if (symmetric) {
      be.syrk(tall, alpha, x, beta, c);
    } else {
      be.gemm(tall, !tall, alpha, x, x, beta, c);
    }
  }
  // C(m×m) = alpha·S·S + beta·C for symmetric S (S·S = S·Sᵀ).
  void square(float alpha, const MatView& s, float beta, const MatView& c) const {
    if (symmetric) {
      be.syrk(false, alpha, s, beta, c);
    } else {
      be.gemm(false, false, alpha, s, s, beta, c);
    }
  }
  // Y(m×n) = S·X + beta·Y for symmetric S (m×m); stored tall, Yᵀ = Xᵀ·S + beta·Yᵀ.
  void left(const MatView& s, const MatView& x, float beta, const MatView& y) const {
    if (tall) {
      be.gemm(false, false, 1.0f, x, s, beta, y);
    } else {
      be.gemm(false, false, 1.0f, s, x, beta, y);
    }
  }
  // C = alpha·A·B + beta·C for m×m factors whose product is symmetric.
  void sym(float alpha, const MatView& a, const MatView& b, float beta, const MatView& c) const {
    if (symmetric) {
      be.symmetric_gemm(alpha, a, b, beta, c, tiles);
    } else {
      be.gemm(false, false, alpha, a, b, beta, c);
    }
  }
  // to ← from, whole chunk.
  void copy(const MatView& from, const MatView& to) const {
    be.copy(to.data, from.data, static_cast<size_t>(from.count * from.batch_stride) * dtype_size(from.dtype));
  }
};

// DESIGN 2.1 on X (m×n, m ≤ n, normalised). Returns the view holding the result (x or y).
MatView standard_recurrence(MatView x, MatView y, const std::vector<NsStep>& schedule, const Products& p,
                            const MatView& a_mat, const MatView& b_mat) {
  for (const NsStep& s : schedule) {
    p.gram(1.0f, x, 0.0f, a_mat);  // A = X·Xᵀ
    p.copy(a_mat, b_mat);
    p.square(float(s.c), a_mat, float(s.b), b_mat);  // B = b·A + c·A·A
    p.copy(x, y);
    p.left(b_mat, x, float(s.a), y);  // X ← a·X + B·X
    std::swap(x, y);
  }
  return x;
}

// DESIGN 2.2 on X (m×n, m ≤ n, normalised): iterates X_t = Q_t·X on m×m matrices, re-forming X and R = X·Xᵀ
// at each restart step. Returns the view holding the result (x or y).
MatView gram_recurrence(MatView x, MatView y, const std::vector<NsStep>& schedule, const std::vector<int>& restarts,
                        const Products& p, MatView r, MatView z, MatView q, MatView t) {
  const auto restart_at = [&](size_t step) {
    return step > 0 && std::find(restarts.begin(), restarts.end(), static_cast<int>(step)) != restarts.end();
  };
  p.gram(1.0f, x, 0.0f, r);  // R = X·Xᵀ
  bool have_q = false;
  for (size_t step = 0; step < schedule.size(); ++step) {
    const float a = float(schedule[step].a), b = float(schedule[step].b), c = float(schedule[step].c);
    if (restart_at(step)) {
      p.left(q, x, 0.0f, y);  // X ← Q·X
      std::swap(x, y);
      p.gram(1.0f, x, 0.0f, r);
      have_q = false;
    }
    p.copy(r, z);
    p.square(c, r, b, z);  // Z = b·R + c·R·R
    if (!have_q) {
      p.copy(z, q);
      p.be.add_identity(q, a);  // Q = Z + a·I
      have_q = true;
    } else {
      p.copy(q, t);
      p.sym(1.0f, q, z, a, t);  // Q ← Q·Z + a·Q
      std::swap(q, t);
    }
    if (step + 1 < schedule.size() && !restart_at(step + 1)) {
      p.copy(r, t);
      p.sym(1.0f, r, z, a, t);  // RZ = R·Z + a·R
      p.copy(t, r);
      p.sym(1.0f, z, t, a, r);  // R ← Z·RZ + a·RZ
    }
  }
  if (!have_q) return x;
  p.left(q, x, 0.0f, y);  // O = Q·X
  return y;
}

// The error for a non-finite input, naming the first bad element (reads U to the host: the error path only).
[[noreturn]] void fail_non_finite(Backend& be, const MatView& u, const std::string& name) {
  std::vector<float> host(static_cast<size_t>(u.elements()));
  be.copy_to_host(host.data(), u.data, host.size() * sizeof(float));
  int64_t i = 0;
  while (i < u.elements() && std::isfinite(host[i])) ++i;
  DMUON_FAIL("Newton-Schulz input '", name, "' (", u.rows, "x", u.cols, ") has a non-finite value ",
             i < u.elements() ? host[i] : NAN, " at row ", i / u.cols, ", column ", i % u.cols);
}

// to ← from for one matrix, converting the dtype where the iterates are stored in another.
void load(Backend& be, const MatView& from, const MatView& to) {
  if (from.dtype == to.dtype) {
    be.copy(to.data, from.data, static_cast<size_t>(from.elements()) * dtype_size(from.dtype));
  } else {
    be.convert(from, to);
  }
}

// What a chunk's recorded work depends on (Backend::run_graph): the shapes, the effective options, the
// schedule's coefficients (as bits), the norms' place, and the address of every matrix and workspace buffer.
std::vector<int64_t> chunk_graph_key(std::span<const MatView> u, std::span<const MatView> o, Chunk chunk,
                                     const NsOptions& e, const std::vector<NsStep>& schedule, const double* norm,
                                     size_t norm_stride, bool norms_in_graph, const Workspace& ws) {
  const auto address = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); };
  const auto bits = [](double x) { return std::bit_cast<int64_t>(x); };
  std::vector<int64_t> key = {u[0].rows,
                              u[0].cols,
                              static_cast<int64_t>(chunk.count),
                              static_cast<int64_t>(e.algo),
                              static_cast<int64_t>(e.dtype),
                              e.symmetric,
                              e.tiles,
                              bits(e.safety),
                              norms_in_graph,
                              address(norm),
                              static_cast<int64_t>(norm_stride),
                              static_cast<int64_t>(e.restarts.size())};
  key.insert(key.end(), e.restarts.begin(), e.restarts.end());
  for (const NsStep& s : schedule) key.insert(key.end(), {bits(s.a), bits(s.b), bits(s.c)});
  for (const Buffer& b : ws.mn) key.push_back(address(b.data()));
  for (const Buffer& b : ws.mm) key.push_back(address(b.data()));
  for (size_t j = 0; j < chunk.count; ++j)
    key.insert(key.end(), {address(u[chunk.at(j)].data), address(o[chunk.at(j)].data)});
  return key;
}

}  // namespace

void orthogonalize_chunk(Backend& be, std::span<const MatView> u, std::span<const MatView> o, Chunk chunk,
                         const NsOptions& options, std::span<const std::string> names, double* norms, Workspace& ws) {
  const int64_t k = static_cast<int64_t>(chunk.count);
  const int64_t rows = u[0].rows, cols = u[0].cols;
  // Work on X (m×n) with m ≤ n: Uᵀ when U is tall, kept in U's layout (see Products).
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const NsOptions e = ns_effective_options(options, rows, cols);
  ws.reserve(m, n, k, e.dtype);  // before any recording: a graph may not allocate
  const std::vector<NsStep> schedule = ns_schedule(e.coeffs, e.steps, e.safety);

  // Norms of the chunk's matrices: in the caller's array at their batch index, else in the workspace.
  double* norm = norms ? norms + chunk.first : ws.norm_slots();
  const size_t norm_stride = norms ? chunk.stride : 1;
  const auto input_norms = [&] {
    for (int64_t j = 0; j < k; ++j) be.frobenius_norms(u[chunk.at(j)], norm + j * norm_stride);
  };
  // Everything after the norms: the many small kernels that a GPU records once per key and replays.
  const auto recurrence = [&] {
    MatView x = ws.mn[0].view(rows, cols, k), y = ws.mn[1].view(rows, cols, k);
    for (int64_t j = 0; j < k; ++j) load(be, u[chunk.at(j)], x.matrix(j));
    if (norm_stride == 1) {
      be.scale_by_inverse_norm(x, norm, e.safety, 1e-7);
    } else {
      for (int64_t j = 0; j < k; ++j) be.scale_by_inverse_norm(x.matrix(j), norm + j * norm_stride, e.safety, 1e-7);
    }
    const Products p{be, m, n, rows > cols, e.symmetric, e.tiles};
    MatView mm[4];
    for (int j = 0; j < 4; ++j) mm[j] = ws.mm[j].view(m, m, k);
    const MatView result = e.algo == NsAlgo::gram
                               ? gram_recurrence(x, y, schedule, e.restarts, p, mm[0], mm[1], mm[2], mm[3])
                               : standard_recurrence(x, y, schedule, p, mm[0], mm[1]);
    for (int64_t j = 0; j < k; ++j) load(be, result.matrix(j), o[chunk.at(j)]);
  };
  if (norms) {  // the caller checks the norms later: the whole chunk is one recording
    be.run_graph(chunk_graph_key(u, o, chunk, e, schedule, norm, norm_stride, true, ws), [&] {
      input_norms();
      recurrence();
    });
    return;
  }
  // Checked here: the norms are read back between the two parts, so only the recurrence is recorded.
  input_norms();
  ws.host_norms.resize(k);
  be.copy_to_host(ws.host_norms.data(), norm, k * sizeof(double));
  for (int64_t j = 0; j < k; ++j) {
    if (std::isfinite(ws.host_norms[j])) continue;
    const size_t i = chunk.at(j);
    fail_non_finite(be, u[i], names.empty() ? "batch[" + std::to_string(i) + "]" : names[i]);
  }
  be.run_graph(chunk_graph_key(u, o, chunk, e, schedule, norm, norm_stride, false, ws), recurrence);
}

}  // namespace ns_detail

NsOptions ns_effective_options(const NsOptions& options, int64_t rows, int64_t cols) {
  NsOptions e = options;
  e.algo = ns_resolve_algo(options.algo, rows, cols);
  e.safety = options.safety > 0 ? options.safety : ns_default_safety(options.coeffs);
  if (e.algo == NsAlgo::standard) e.restarts.clear();
  if (e.algo == NsAlgo::standard || !e.symmetric) e.tiles = 1;
  return e;
}

double standard_ns_flops(int64_t rows, int64_t cols, int steps) {
  const double m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  return steps * (4 * m * m * n + 2 * m * m * m);
}

}  // namespace dmuon
