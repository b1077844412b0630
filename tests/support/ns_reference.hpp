// Slow, obvious float64 Newton–Schulz for the tests only (DESIGN 2.1 and 2.2 read literally, naive loops,
// full products everywhere), plus float64 matrix helpers to build test inputs. Header-only so that the
// test-support library needs no new source file.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "dmuon/ns.hpp"

namespace dmuon::test {

// Row-major float64 matrix.
struct MatD {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  MatD() = default;
  MatD(int64_t r, int64_t c) : rows(r), cols(c), v(r * c, 0.0) {}
  double& operator()(int64_t i, int64_t j) { return v[i * cols + j]; }
  double operator()(int64_t i, int64_t j) const { return v[i * cols + j]; }
};

inline MatD from_floats(const float* x, int64_t rows, int64_t cols) {
  MatD m(rows, cols);
  std::copy(x, x + rows * cols, m.v.begin());
  return m;
}

inline std::vector<float> to_floats(const MatD& m) { return std::vector<float>(m.v.begin(), m.v.end()); }

inline MatD transposed(const MatD& a) {
  MatD t(a.cols, a.rows);
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int64_t j = 0; j < a.cols; ++j) t(j, i) = a(i, j);
  }
  return t;
}

// alpha·A·B + beta·C (C may be empty when beta is 0).
inline MatD matmul(const MatD& a, const MatD& b, double alpha = 1.0, double beta = 0.0, const MatD* c = nullptr) {
  MatD out(a.rows, b.cols);
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int64_t k = 0; k < a.cols; ++k) {
      const double aik = alpha * a(i, k);
      for (int64_t j = 0; j < b.cols; ++j) out(i, j) += aik * b(k, j);
    }
    if (c) {
      for (int64_t j = 0; j < b.cols; ++j) out(i, j) += beta * (*c)(i, j);
    }
  }
  return out;
}

inline MatD identity_plus(const MatD& a, double alpha) {  // A + alpha·I
  MatD out = a;
  for (int64_t i = 0; i < a.rows; ++i) out(i, i) += alpha;
  return out;
}

inline double frobenius(const MatD& a) {
  double s = 0;
  for (double x : a.v) s += x * x;
  return std::sqrt(s);
}

// ‖A − B‖_F / ‖B‖_F.
inline double relative_distance(const MatD& a, const MatD& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.v.size(); ++i) {
    d += (a.v[i] - b.v[i]) * (a.v[i] - b.v[i]);
    n += b.v[i] * b.v[i];
  }
  return std::sqrt(d / n);
}

// X (m×n, m ≤ n) = U or Uᵀ, normalised as DESIGN 2.1: U / (‖U‖_F·safety + 1e-7).
inline MatD normalised_wide(const MatD& u, double safety) {
  MatD x = u.rows > u.cols ? transposed(u) : u;
  const double s = 1.0 / (frobenius(u) * safety + 1e-7);
  for (double& e : x.v) e *= s;
  return x;
}

inline MatD back_to_shape(const MatD& x, const MatD& u) { return u.rows > u.cols ? transposed(x) : x; }

// DESIGN 2.1 in float64: A = X·Xᵀ; B = b·A + c·A·A; X = a·X + B·X.
inline MatD standard_ns_reference(const MatD& u, const std::vector<NsStep>& schedule, double safety) {
  MatD x = normalised_wide(u, safety);
  for (const NsStep& s : schedule) {
    MatD a = matmul(x, transposed(x));
    MatD b = matmul(a, a, s.c, s.b, &a);
    x = matmul(b, x, 1.0, s.a, &x);
  }
  return back_to_shape(x, u);
}

// DESIGN 2.2 in float64, line by line.
inline MatD gram_ns_reference(const MatD& u, const std::vector<NsStep>& schedule, double safety,
                              const std::vector<int>& restarts) {
  const auto restart_at = [&](size_t t) {
    return t > 0 && std::find(restarts.begin(), restarts.end(), static_cast<int>(t)) != restarts.end();
  };
  MatD x = normalised_wide(u, safety);
  MatD r = matmul(x, transposed(x));
  MatD q;
  bool have_q = false;
  for (size_t t = 0; t < schedule.size(); ++t) {
    const NsStep& s = schedule[t];
    if (restart_at(t)) {
      x = matmul(q, x);
      r = matmul(x, transposed(x));
      have_q = false;
    }
    MatD z = matmul(r, r, s.c, s.b, &r);
    q = have_q ? matmul(q, z, 1.0, s.a, &q) : identity_plus(z, s.a);
    have_q = true;
    if (t + 1 < schedule.size() && !restart_at(t + 1)) {
      MatD rz = matmul(r, z, 1.0, s.a, &r);
      r = matmul(z, rz, 1.0, s.a, &rz);
    }
  }
  return back_to_shape(have_q ? matmul(q, x) : x, u);
}

inline MatD gaussian(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  MatD m(rows, cols);
  for (double& e : m.v) e = normal(rng);
  return m;
}

// A rows×k matrix with orthonormal columns (modified Gram–Schmidt on a Gaussian), k ≤ rows.
inline MatD orthonormal_columns(int64_t rows, int64_t k, uint64_t seed) {
  MatD q = gaussian(rows, k, seed);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t p = 0; p < j; ++p) {
      double d = 0;
      for (int64_t i = 0; i < rows; ++i) d += q(i, p) * q(i, j);
      for (int64_t i = 0; i < rows; ++i) q(i, j) -= d * q(i, p);
    }
    double n = 0;
    for (int64_t i = 0; i < rows; ++i) n += q(i, j) * q(i, j);
    n = std::sqrt(n);
    for (int64_t i = 0; i < rows; ++i) q(i, j) /= n;
  }
  return q;
}

// U·diag(sigma)·Vᵀ with random orthonormal U (rows×k), V (cols×k), k = sigma.size().
inline MatD with_spectrum(int64_t rows, int64_t cols, const std::vector<double>& sigma, uint64_t seed) {
  const auto k = static_cast<int64_t>(sigma.size());
  MatD u = orthonormal_columns(rows, k, seed);
  MatD v = orthonormal_columns(cols, k, seed + 1);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < k; ++j) u(i, j) *= sigma[j];
  }
  return matmul(u, transposed(v));
}

}  // namespace dmuon::test
