// Slow, obvious float64 Newton–Schulz for the tests only (DESIGN 2.1 and 2.2 read literally, naive loops,
// full products everywhere), plus float64 matrix helpers to build test inputs. Header-only so that the
// test-support library needs no new source file.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// ---- the GPU's bfloat16 Newton–Schulz, emulated ----
// src/ns/newton_schulz.cpp with bf16 iterates (NsOptions::dtype = bf16) as the CUDA backend runs it: U is
// rounded to bf16 when loaded, normalised by a float32 scale from its float64 norm and rounded again; every
// product and update (C = α·A·B + β·C, α and β as float) accumulates in Acc and is rounded to bf16 once when
// stored (cuBLAS GemmEx with float32 compute: Acc = float is the GPU, Acc = double shows what the accumulation
// order alone changes); m×m products are computed on and above the diagonal and mirrored (SYRK and the tiled
// symmetric products), so they stay exactly symmetric; a copy is exact; Q = Z + a·I adds in float. With `round`
// off and Acc = double it is the float64 recurrences above (to float64 rounding). A correct GPU result lies
// within accumulation noise of it, where the float64 recurrence is about 1e-2 away (the iterates' rounding), so
// a kernel bug stands out here.
template <typename Acc>
struct Bf16Emulation {
  bool round = true;

  double store(double x) const {
    if (!round) return x;
    const float f = static_cast<float>(x);  // the float32 accumulator's value
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return NAN;
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;  // nearest even
    float r;
    std::memcpy(&r, &bits, 4);
    return r;
  }
  Acc coefficient(double x) const { return round ? static_cast<Acc>(static_cast<float>(x)) : static_cast<Acc>(x); }
  // store(alpha·A·B + beta·C), B given transposed (bt = Bᵀ, so both are read along rows); symmetric: the result is
  // known to be, so only j ≥ i is computed and mirrored.
  MatD product(const MatD& a, const MatD& bt, double alpha, double beta = 0, const MatD* c = nullptr,
               bool symmetric = false) const {
    MatD out(a.rows, bt.rows);
    for (int64_t i = 0; i < a.rows; ++i) {
      for (int64_t j = symmetric ? i : 0; j < bt.rows; ++j) {
        Acc sum = 0;
        for (int64_t k = 0; k < a.cols; ++k) sum += static_cast<Acc>(a(i, k)) * static_cast<Acc>(bt(j, k));
        Acc r = coefficient(alpha) * sum;
        if (c) r += coefficient(beta) * static_cast<Acc>((*c)(i, j));
        out(i, j) = store(static_cast<double>(r));
        if (symmetric) out(j, i) = out(i, j);
      }
    }
    return out;
  }
  MatD symmetric_product(const MatD& a, const MatD& bt, double alpha, double beta = 0, const MatD* c = nullptr) const {
    return product(a, bt, alpha, beta, c, true);
  }
  // X (m×n, m ≤ n) from U as the engine loads and normalises it.
  MatD normalised(const MatD& u, double safety) const {
    if (!round) return normalised_wide(u, safety);
    MatD x = u.rows > u.cols ? transposed(u) : u;
    const auto s = static_cast<float>(1.0 / (frobenius(u) * safety + 1e-7));
    for (double& e : x.v) e = store(static_cast<double>(static_cast<float>(store(e)) * s));
    return x;
  }

  MatD standard(const MatD& u, const std::vector<NsStep>& schedule, double safety) const {
    MatD x = normalised(u, safety);
    for (const NsStep& s : schedule) {
      const MatD a = symmetric_product(x, x, 1.0);         // A = X·Xᵀ
      const MatD b = symmetric_product(a, a, s.c, s.b, &a);  // B = c·A·A + b·A
      x = product(b, transposed(x), 1.0, s.a, &x);         // X = B·X + a·X
    }
    return back_to_shape(x, u);
  }

  MatD gram(const MatD& u, const std::vector<NsStep>& schedule, double safety, const std::vector<int>& restarts) const {
    const auto restart_at = [&](size_t t) {
      return t > 0 && std::find(restarts.begin(), restarts.end(), static_cast<int>(t)) != restarts.end();
    };
    MatD x = normalised(u, safety);
    MatD r = symmetric_product(x, x, 1.0);
    MatD q;
    bool have_q = false;
    for (size_t t = 0; t < schedule.size(); ++t) {
      const NsStep& s = schedule[t];
      if (restart_at(t)) {
        x = product(q, transposed(x), 1.0);                // X = Q·X
        r = symmetric_product(x, x, 1.0);
        have_q = false;
      }
      const MatD z = symmetric_product(r, r, s.c, s.b, &r);  // Z = c·R·R + b·R
      if (have_q) {
        q = symmetric_product(q, z, 1.0, s.a, &q);         // Q = Q·Z + a·Q
      } else {
        q = z;
        for (int64_t i = 0; i < q.rows; ++i)               // Q = Z + a·I, added in float
          q(i, i) = round ? store(static_cast<float>(q(i, i)) + static_cast<float>(s.a)) : q(i, i) + s.a;
        have_q = true;
      }
      if (t + 1 < schedule.size() && !restart_at(t + 1)) {
        const MatD rz = symmetric_product(r, z, 1.0, s.a, &r);  // RZ = R·Z + a·R
        r = symmetric_product(z, rz, 1.0, s.a, &rz);            // R = Z·RZ + a·RZ
      }
    }
    return back_to_shape(have_q ? product(q, transposed(x), 1.0) : x, u);
  }
};

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
