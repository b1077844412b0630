// Row-major requests → column-major cuBLAS call descriptors (see cublas_calls.hpp). Plain C++: built in every
// configuration so the mapping is tested on machines without a GPU.
#include "backend/cuda/cublas_calls.hpp"

#include <algorithm>
#include <climits>

#include "dmuon/error.hpp"

namespace dmuon::cuda {

namespace {

// One row-major (strided-batched) product C(m×n) = op(A)·op(B) on sub-blocks of the request's views.
struct RowMajorProduct {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  Source a_source = Source::a, b_source = Source::b;
  int64_t a_offset = 0, b_offset = 0, c_offset = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
};

void check_int(int64_t v, const char* what, const char* op) {
  DMUON_CHECK(v >= 0 && v <= INT_MAX, op, ": ", what, " ", v, " is outside cuBLAS's int range");
}

// The single place where row-major becomes column-major: swap the operands (and m with n), keep each
// operand's transpose flag and leading dimension.
BlasCall column_major(const RowMajorProduct& r, float alpha, float beta, DType ab_type, DType c_type) {
  BlasCall call;
  call.kind = BlasCall::Kind::gemm;
  call.trans_a = r.trans_b;
  call.trans_b = r.trans_a;
  call.m = r.n;
  call.n = r.m;
  call.k = r.k;
  call.alpha = alpha;
  call.beta = beta;
  call.a_source = r.b_source;
  call.a_offset = r.b_offset;
  call.lda = r.ldb;
  call.stride_a = r.stride_b;
  call.b_source = r.a_source;
  call.b_offset = r.a_offset;
  call.ldb = r.lda;
  call.stride_b = r.stride_a;
  call.c_offset = r.c_offset;
  call.ldc = r.ldc;
  call.stride_c = r.stride_c;
  call.batch = r.batch;
  call.ab_type = ab_type;
  call.c_type = c_type;
  for (int64_t v : {call.m, call.n, call.k, call.lda, call.ldb, call.ldc, call.batch}) check_int(v, "dimension", "gemm");
  return call;
}

void check_view(const MatView& v, const char* name, const char* op) {
  DMUON_CHECK(v.rows >= 0 && v.cols >= 0 && v.count >= 1, op, ": ", name, " has shape ", v.count, "x", v.rows, "x",
              v.cols);
  DMUON_CHECK(v.ld >= std::max<int64_t>(v.cols, 1), op, ": ", name, " (", v.rows, "x", v.cols, ") has row stride ", v.ld,
              " < cols");
}

// The matrices of an output batch must not overlap (inputs may, e.g. stride 0).
void check_output(const MatView& c, const char* op) {
  check_view(c, "C", op);
  DMUON_CHECK(c.count == 1 || c.empty() || c.batch_stride >= (c.rows - 1) * c.ld + c.cols, op, ": C's batch stride ",
              c.batch_stride, " overlaps its ", c.rows, "x", c.cols, " matrices (row stride ", c.ld, ")");
}

void check_types(const MatView& a, const MatView& b, const MatView& c, const char* op) {
  DMUON_CHECK(a.dtype == b.dtype, op, ": operands are ", to_string(a.dtype), " and ", to_string(b.dtype));
  DMUON_CHECK(c.dtype == DType::f32 || c.dtype == a.dtype, op, ": ", to_string(a.dtype), " operands into a ",
              to_string(c.dtype), " result");
}

void check_counts(const MatView& a, const MatView& b, const MatView& c, const char* op) {
  DMUON_CHECK(a.count == c.count && b.count == c.count, op, ": batch counts differ (", a.count, ", ", b.count, ", ",
              c.count, ")");
}

// The whole request as one product (batched over the views' matrices).
RowMajorProduct whole(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, Source a_source,
                      const MatView& a, Source b_source, const MatView& b, const MatView& c) {
  RowMajorProduct r;
  r.trans_a = trans_a;
  r.trans_b = trans_b;
  r.m = m;
  r.n = n;
  r.k = k;
  r.a_source = a_source;
  r.b_source = b_source;
  r.lda = a.ld;
  r.ldb = b.ld;
  r.ldc = c.ld;
  r.batch = c.count;
  r.stride_a = a.batch_stride;
  r.stride_b = b.batch_stride;
  r.stride_c = c.batch_stride;
  return r;
}

// The upper tiles of the m×m product `full` (see the header): offsets of op(A)'s row block i, op(B)'s column
// block j and C's tile (i, j) are linear in i and j.
std::vector<RowMajorProduct> upper_tiles(const RowMajorProduct& full, int tiles) {
  const int64_t m = full.m;
  const int64_t t = std::min<int64_t>(tiles, m);
  const int64_t b = m / t, rest = m - t * b;
  const int64_t a_step = full.trans_a ? b : b * full.lda;  // op(A) row block
  const int64_t b_step = full.trans_b ? b * full.ldb : b;  // op(B) column block
  const int64_t c_row = b * full.ldc, c_col = b;
  std::vector<RowMajorProduct> out;
  auto tile = [&](int64_t i, int64_t j) {
    RowMajorProduct r = full;
    r.m = b;
    r.n = b;
    r.a_offset = full.a_offset + i * a_step;
    r.b_offset = full.b_offset + j * b_step;
    r.c_offset = full.c_offset + i * c_row + j * c_col;
    return r;
  };
  if (full.batch == 1) {
    for (int64_t d = 0; d < t; ++d) {  // diagonal d: tiles (i, i+d), i = 0..t−d−1, equally spaced
      RowMajorProduct r = tile(0, d);
      r.batch = t - d;
      r.stride_a = a_step;
      r.stride_b = b_step;
      r.stride_c = c_row + c_col;
      out.push_back(r);
    }
  } else {
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = i; j < t; ++j) out.push_back(tile(i, j));  // batched over the matrices
  }
  if (rest > 0) {  // columns [t·b, m) of every row
    RowMajorProduct r = full;
    r.n = rest;
    r.b_offset = full.b_offset + t * b_step;
    r.c_offset = full.c_offset + t * c_col;
    out.push_back(r);
  }
  return out;
}

std::vector<BlasCall> to_calls(const std::vector<RowMajorProduct>& products, float alpha, float beta, DType ab_type,
                               DType c_type) {
  std::vector<BlasCall> calls;
  for (const auto& p : products) calls.push_back(column_major(p, alpha, beta, ab_type, c_type));
  return calls;
}

}  // namespace

int syrk_tiles(int64_t n) { return static_cast<int>(std::clamp<int64_t>(n / 512, 1, 8)); }

std::vector<BlasCall> gemm_calls(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b,
                                 float beta, const MatView& c) {
  check_view(a, "A", "gemm");
  check_view(b, "B", "gemm");
  check_output(c, "gemm");
  check_types(a, b, c, "gemm");
  check_counts(a, b, c, "gemm");
  const int64_t m = trans_a ? a.cols : a.rows, k = trans_a ? a.rows : a.cols;
  const int64_t kb = trans_b ? b.cols : b.rows, n = trans_b ? b.rows : b.cols;
  DMUON_CHECK(kb == k && c.rows == m && c.cols == n, "gemm: op(A) is ", m, "x", k, ", op(B) ", kb, "x", n, ", C ",
              c.rows, "x", c.cols);
  if (m == 0 || n == 0) return {};
  return to_calls({whole(trans_a, trans_b, m, n, k, Source::a, a, Source::b, b, c)}, alpha, beta, a.dtype, c.dtype);
}

std::vector<BlasCall> syrk_calls(bool trans, float alpha, const MatView& a, float beta, const MatView& c,
                                 SyrkMethod method) {
  check_view(a, "A", "syrk");
  check_output(c, "syrk");
  check_types(a, a, c, "syrk");
  check_counts(a, a, c, "syrk");
  const int64_t n = trans ? a.cols : a.rows, k = trans ? a.rows : a.cols;
  DMUON_CHECK(c.rows == n && c.cols == n, "syrk: op(A) is ", n, "x", k, " but C is ", c.rows, "x", c.cols);
  if (n == 0) return {};
  if (!method.native) {
    DMUON_CHECK(method.tiles >= 1, "syrk: tile count must be at least 1, got ", method.tiles);
    // op(A)·op(A)ᵀ as a general product of the view with itself.
    const auto full = whole(trans, !trans, n, n, k, Source::a, a, Source::a, a, c);
    return to_calls(upper_tiles(full, method.tiles), alpha, beta, a.dtype, c.dtype);
  }
  DMUON_CHECK(a.dtype == DType::f32 && c.dtype == DType::f32 && c.count == 1,
              "syrk: a native SYRK takes one float32 matrix (got ", to_string(a.dtype), ", ", c.count, " matrices)");
  BlasCall call;
  call.kind = BlasCall::Kind::syrk;
  call.lower = true;       // row-major upper triangle
  call.trans_a = !trans;   // row-major A (n×k) is column-major Aᵀ (k×n): C = (Aᵀ)ᵀ·Aᵀ
  call.n = n;
  call.k = k;
  call.m = n;
  call.alpha = alpha;
  call.beta = beta;
  call.a_source = Source::a;
  call.lda = a.ld;
  call.ldc = c.ld;
  for (int64_t v : {call.n, call.k, call.lda, call.ldc}) check_int(v, "dimension", "syrk");
  return {call};
}

std::vector<BlasCall> symmetric_gemm_calls(float alpha, const MatView& a, const MatView& b, float beta,
                                           const MatView& c, int tiles) {
  check_view(a, "A", "symmetric_gemm");
  check_view(b, "B", "symmetric_gemm");
  check_output(c, "symmetric_gemm");
  check_types(a, b, c, "symmetric_gemm");
  check_counts(a, b, c, "symmetric_gemm");
  DMUON_CHECK(tiles >= 1, "symmetric_gemm: tile count must be at least 1, got ", tiles);
  const int64_t m = a.rows, k = a.cols;
  DMUON_CHECK(b.rows == k && b.cols == m && c.rows == m && c.cols == m, "symmetric_gemm: A is ", a.rows, "x", a.cols,
              ", B ", b.rows, "x", b.cols, ", C ", c.rows, "x", c.cols, " (need A m×k, B k×m, C m×m)");
  if (m == 0) return {};
  const auto full = whole(false, false, m, m, k, Source::a, a, Source::b, b, c);
  return to_calls(upper_tiles(full, tiles), alpha, beta, a.dtype, c.dtype);
}

}  // namespace dmuon::cuda
