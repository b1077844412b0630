// Newton–Schulz on one matrix (DESIGN 2.1, 2.2): normalisation and input checks, the standard recurrence, the
// Gram-space recurrence, and the workspace pool they draw their buffers from.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>

#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "ns/workspace.hpp"

namespace dmuon {
namespace ns_detail {

void Workspace::reserve(int64_t m, int64_t n) {
  for (auto& b : mn) {
    if (b.size() < static_cast<size_t>(m * n)) b.resize(m * n);
  }
  for (auto& b : mm) {
    if (b.size() < static_cast<size_t>(m * m)) b.resize(m * m);
  }
}

namespace {
std::mutex pool_mutex;
std::vector<std::unique_ptr<Workspace>>& pool() {
  static std::vector<std::unique_ptr<Workspace>> free_workspaces;
  return free_workspaces;
}
}  // namespace

WorkspaceLease::WorkspaceLease() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool().empty()) {
    ws_ = std::make_unique<Workspace>();
  } else {
    ws_ = std::move(pool().back());
    pool().pop_back();
  }
}

WorkspaceLease::~WorkspaceLease() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool().push_back(std::move(ws_));
}

void check_options(const NsOptions& options) {
  DMUON_CHECK(options.steps >= 0, "Newton-Schulz steps must be non-negative, got ", options.steps);
  DMUON_CHECK(options.tiles >= 1, "Newton-Schulz tiles must be at least 1, got ", options.tiles);
  DMUON_CHECK(std::isfinite(options.safety) && options.safety >= 0,
              "Newton-Schulz safety must be finite and non-negative (0: the "
              "schedule's default), got ",
              options.safety);
  for (int r : options.restarts) DMUON_CHECK(r >= 0, "Newton-Schulz restart steps must be non-negative, got ", r);
}

namespace {

// The products of the recurrences on X (m×n, m ≤ n), as SYRK / upper-triangle gemm, or full gemm when
// options.symmetric is false (the cost of the public reference code). A tall input U (n×m) is used in place
// as X = Uᵀ through BLAS transpose flags, so it is never transposed in memory.
struct Products {
  int64_t m, n;
  bool tall;  // X is stored as Xᵀ (n×m row-major)
  bool symmetric;
  int tiles;

  // C(m×m) = alpha·X·Xᵀ + beta·C.
  void gram(float alpha, const float* x, float beta, float* c) const {
    const int64_t ld = tall ? m : n;
    if (symmetric) {
      if (tall) {
        linalg::syrk_transposed(m, n, alpha, x, ld, beta, c, m);
      } else {
        linalg::syrk(m, n, alpha, x, ld, beta, c, m);
      }
    } else {
      linalg::gemm(tall, !tall, m, m, n, alpha, x, ld, x, ld, beta, c, m);
    }
  }
  // C(m×m) = alpha·S·S + beta·C for symmetric S (S·S = S·Sᵀ).
  void square(float alpha, const float* s, float beta, float* c) const {
    if (symmetric) {
      linalg::syrk(m, m, alpha, s, m, beta, c, m);
    } else {
      linalg::gemm(false, false, m, m, m, alpha, s, m, s, m, beta, c, m);
    }
  }
  // Y(m×n) = S·X + beta·Y for symmetric S (m×m); stored tall, Yᵀ = Xᵀ·S + beta·Yᵀ.
  void left(const float* s, const float* x, float beta, float* y) const {
    if (tall) {
      linalg::gemm(false, false, n, m, m, 1.0f, x, m, s, m, beta, y, m);
    } else {
      linalg::gemm(false, false, m, n, m, 1.0f, s, m, x, n, beta, y, n);
    }
  }
  // C = alpha·A·B + beta·C for m×m factors whose product is symmetric.
  void sym(float alpha, const float* a, const float* b, float beta, float* c) const {
    if (symmetric) {
      linalg::symmetric_gemm(m, m, alpha, a, m, b, m, beta, c, m, tiles);
    } else {
      linalg::gemm(false, false, m, m, m, alpha, a, m, b, m, beta, c, m);
    }
  }
};

void copy(int64_t n, const float* from, float* to) { std::memcpy(to, from, n * sizeof(float)); }

// DESIGN 2.1 on X (m×n, m ≤ n, normalised). Returns the buffer holding the result (x or y).
float* standard_recurrence(float* x, float* y, const std::vector<NsStep>& schedule, const Products& p, float* a_mat,
                           float* b_mat) {
  const int64_t m = p.m;
  for (const NsStep& s : schedule) {
    p.gram(1.0f, x, 0.0f, a_mat);  // A = X·Xᵀ
    copy(m * m, a_mat, b_mat);
    p.square(float(s.c), a_mat, float(s.b), b_mat);  // B = b·A + c·A·A
    copy(m * p.n, x, y);
    p.left(b_mat, x, float(s.a), y);  // X ← a·X + B·X
    std::swap(x, y);
  }
  return x;
}

// DESIGN 2.2 on X (m×n, m ≤ n, normalised): iterates X_t = Q_t·X on m×m matrices, re-forming X and R = X·Xᵀ
// at each restart step. Returns the buffer holding the result (x or y).
float* gram_recurrence(float* x, float* y, const std::vector<NsStep>& schedule, const std::vector<int>& restarts,
                       const Products& p, float* r, float* z, float* q, float* t) {
  const int64_t m = p.m;
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
    copy(m * m, r, z);
    p.square(c, r, b, z);  // Z = b·R + c·R·R
    if (!have_q) {
      copy(m * m, z, q);
      linalg::add_identity(m, a, q, m);  // Q = Z + a·I
      have_q = true;
    } else {
      copy(m * m, q, t);
      p.sym(1.0f, q, z, a, t);  // Q ← Q·Z + a·Q
      std::swap(q, t);
    }
    if (step + 1 < schedule.size() && !restart_at(step + 1)) {
      copy(m * m, r, t);
      p.sym(1.0f, r, z, a, t);  // RZ = R·Z + a·R
      copy(m * m, t, r);
      p.sym(1.0f, z, t, a, r);  // R ← Z·RZ + a·RZ
    }
  }
  if (!have_q) return x;
  p.left(q, x, 0.0f, y);  // O = Q·X
  return y;
}

[[noreturn]] void fail_non_finite(const float* u, int64_t rows, int64_t cols, const std::string& name) {
  int64_t i = 0;
  while (i < rows * cols && std::isfinite(u[i])) ++i;
  DMUON_FAIL("Newton-Schulz input '", name, "' (", rows, "x", cols, ") has a non-finite value ", u[i], " at row ",
             i / cols, ", column ", i % cols);
}

}  // namespace

}  // namespace ns_detail

NsOptions ns_effective_options(const NsOptions& options, int64_t rows, int64_t cols) {
  NsOptions e = options;
  e.algo = ns_resolve_algo(options.algo, rows, cols);
  e.safety = options.safety > 0 ? options.safety : ns_default_safety(options.coeffs);
  if (e.algo == NsAlgo::standard) e.restarts.clear();
  if (e.algo == NsAlgo::standard || !e.symmetric) e.tiles = 1;
  return e;
}

namespace ns_detail {

void orthogonalize(const float* u, float* o, int64_t rows, int64_t cols, const NsOptions& options,
                   const std::string& name, Workspace& ws) {
  DMUON_CHECK(rows >= 0 && cols >= 0, "Newton-Schulz input '", name, "' has a negative shape ", rows, "x", cols);
  if (rows == 0 || cols == 0) return;
  const double norm = linalg::norm2(rows * cols, u);
  if (!std::isfinite(norm)) fail_non_finite(u, rows, cols, name);

  // Work on X (m×n) with m ≤ n: Uᵀ when U is tall, kept in U's layout (see Products).
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  ws.reserve(m, n);
  float* x = ws.mn[0].data();
  float* y = ws.mn[1].data();
  copy(m * n, u, x);
  const NsOptions e = ns_effective_options(options, rows, cols);
  linalg::scale(m * n, static_cast<float>(1.0 / (norm * e.safety + 1e-7)), x);

  const std::vector<NsStep> schedule = ns_schedule(e.coeffs, e.steps, e.safety);
  const Products p{m, n, rows > cols, e.symmetric, e.tiles};
  float* result = nullptr;
  if (e.algo == NsAlgo::gram) {
    result = gram_recurrence(x, y, schedule, e.restarts, p, ws.mm[0].data(), ws.mm[1].data(), ws.mm[2].data(),
                             ws.mm[3].data());
  } else {
    result = standard_recurrence(x, y, schedule, p, ws.mm[0].data(), ws.mm[1].data());
  }
  copy(m * n, result, o);
}

}  // namespace ns_detail

void newton_schulz(const float* u, float* o, int64_t rows, int64_t cols, const NsOptions& options,
                   const std::string& name) {
  ns_detail::check_options(options);
  linalg::ThreadsScope threads(options.threads);
  ns_detail::WorkspaceLease ws;
  ns_detail::orthogonalize(u, o, rows, cols, options, name, *ws);
}

double standard_ns_flops(int64_t rows, int64_t cols, int steps) {
  const double m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  return steps * (4 * m * m * n + 2 * m * m * m);
}

}  // namespace dmuon
