// cpu_bf16.hpp's general products on oneDNN's matmul (a private dependency of this file only): one primitive
// per shape, strides, transposes, alpha, beta, dtype and thread count, built once per thread and kept (oneDNN's own
// cache would still build a descriptor per call), run on this thread's stream with a scratchpad this thread owns, so
// the CPU backend's concurrent workers (run_concurrently) never share oneDNN state. alpha is the matmul's output
// scale and beta·C its sum post-op: dst = alpha·Σ + beta·dst in float32, rounded to dst's type once.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "backend/bf16.hpp"
#include "backend/cpu_bf16.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"

namespace dmuon::cpu_bf16 {

namespace {

using dnnl::memory;
using Dims = memory::dims;

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

// op(X) (rows×cols) of X stored row-major with row stride ld, X or, with trans, Xᵀ.
memory::desc operand(memory::data_type type, bool trans, int64_t rows, int64_t cols, int64_t ld) {
  return memory::desc(Dims{rows, cols}, type, trans ? Dims{1, ld} : Dims{ld, 1});
}

dnnl::matmul::primitive_desc matmul_desc(memory::data_type type, bool trans_a, bool trans_b, int64_t m, int64_t n,
                                         int64_t k, float alpha, int64_t lda, int64_t ldb, float beta, int64_t ldc) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops sum;
    sum.append_sum(beta);
    attr.set_post_ops(sum);
  }
  const dnnl::matmul::desc d(operand(type, trans_a, m, k, lda), operand(type, trans_b, k, n, ldb),
                             operand(type, false, m, n, ldc));
  return dnnl::matmul::primitive_desc(d, attr, engine());
}

// What a primitive depends on; floats as bits.
using Key = std::tuple<int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t, uint32_t, int>;

struct Primitive {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul matmul;
};

struct Thread {
  dnnl::stream stream{engine()};
  std::map<Key, Primitive> primitives;
  std::vector<uint8_t> scratchpad;
};

Thread& this_thread() {
  thread_local Thread t;
  return t;
}

// C = alpha·op(A)·op(B) + beta·C on oneDNN with the CPU backend's thread count (k ≥ 1).
void matmul(memory::data_type type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const int threads = linalg::threads();
  omp_set_num_threads(threads);  // this thread's OpenMP team for oneDNN, as OpenBLAS's for float32 products
  Thread& t = this_thread();
  const Key key{static_cast<int>(type), trans_a, trans_b, m, n, k, lda, ldb, ldc, std::bit_cast<uint32_t>(alpha),
                std::bit_cast<uint32_t>(beta), threads};
  auto found = t.primitives.find(key);
  if (found == t.primitives.end()) {
    try {
      const auto pd = matmul_desc(type, trans_a, trans_b, m, n, k, alpha, lda, ldb, beta, ldc);
      found = t.primitives.emplace(key, Primitive{pd, dnnl::matmul(pd)}).first;
    } catch (const dnnl::error& e) {
      DMUON_FAIL("oneDNN matmul ", m, "x", k, " · ", k, "x", n, ": ", e.what());
    }
  }
  const dnnl::matmul::primitive_desc& pd = found->second.pd;
  t.scratchpad.resize(std::max<size_t>(pd.scratchpad_desc().get_size(), 1));
  memory a_mem(pd.src_desc(), engine(), const_cast<void*>(a));
  memory b_mem(pd.weights_desc(), engine(), const_cast<void*>(b));
  memory c_mem(pd.dst_desc(), engine(), c);
  memory pad(pd.scratchpad_desc(), engine(), t.scratchpad.data());
  found->second.matmul.execute(t.stream, {{DNNL_ARG_SRC, a_mem},
                                   {DNNL_ARG_WEIGHTS, b_mem},
                                   {DNNL_ARG_DST, c_mem},
                                   {DNNL_ARG_SCRATCHPAD, pad}});
  t.stream.wait();
}

// Whether oneDNN builds bf16 matmuls on this CPU (AVX-512 or newer); the implementation it picks.
const std::string& bf16_implementation() {
  static const std::string impl = [] {
    try {
      return std::string(matmul_desc(memory::data_type::bf16, false, false, 256, 256, 256, 1.0f, 256, 256, 0.0f, 256)
                             .impl_info_str());
    } catch (const dnnl::error&) {
      return std::string();
    }
  }();
  return impl;
}

// The rows×cols bf16 matrix at x (row stride ld), widened into `to` (contiguous).
void widen(const uint16_t* x, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& to) {
  to.resize(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) to[i * cols + j] = bf16_value(x[i * ld + j]);
  }
}

}  // namespace

bool available() { return true; }

bool native() {
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16_units = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);  // ISAs are nested bit sets
  return (isa & bf16_units) == bf16_units && !bf16_implementation().empty();
}

bool matrix_units() {
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  return (isa & amx) == amx && !bf16_implementation().empty();
}

std::string description() {
  const dnnl_version_t* v = dnnl_version();
  const std::string version =
      "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  if (bf16_implementation().empty()) return version + ", bf16 through float32 (no bf16 support on this CPU)";
  return version + ", bf16 on " + bf16_implementation() + (native() ? "" : " (no bf16 units)");
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
          const uint16_t* b, int64_t ldb, float beta, uint16_t* c, int64_t ldc) {
  if (k == 0) {  // C = beta·C, not read when beta is 0 (BLAS's rule)
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0 : bf16_bits(beta * bf16_value(c[i * ldc + j]));
    }
    return;
  }
  if (!bf16_implementation().empty()) {
    matmul(memory::data_type::bf16, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // No bf16 matmul on this CPU: the bf16 values widened (exactly), multiplied in float32, C rounded once. The
  // products of two bf16 values are exact in float32, so this is a bf16 matmul with another summation order.
  thread_local std::vector<float> wa, wb, wc;
  widen(a, trans_a ? k : m, trans_a ? m : k, lda, wa);
  widen(b, trans_b ? n : k, trans_b ? k : n, ldb, wb);
  if (beta != 0.0f) {
    widen(c, m, n, ldc, wc);
  } else {
    wc.assign(static_cast<size_t>(m * n), 0.0f);
  }
  gemm_f32(trans_a, trans_b, m, n, k, alpha, wa.data(), trans_a ? m : k, wb.data(), trans_b ? k : n, beta, wc.data(),
           n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = bf16_bits(wc[i * n + j]);
  }
}

void gemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    }
    return;
  }
  matmul(memory::data_type::f32, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace dmuon::cpu_bf16
