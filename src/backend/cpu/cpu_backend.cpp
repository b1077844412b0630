// The CPU backend's memory, products, elementwise operations and queue (cpu_backend.hpp), each a thin
// loop over the batch around the linalg.hpp functions, so the engine on this backend makes exactly the
// BLAS calls it made before the seam; bf16 products through oneDNN (cpu_bf16.hpp) and the elementwise
// operations Newton–Schulz runs on bf16 iterates (scale, add_identity, fill, mirror_upper: computed in float32,
// rounded once); the update rules through their CPU launchers (src/backend/rules/).
#include "backend/cpu/cpu_backend.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <thread>
#include <variant>
#include <vector>

#include "backend/bf16.hpp"
#include "backend/cpu_bf16.hpp"
#include "backend/rules/launch.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon {

namespace {

// Host memory aligned for vector loads (64 bytes: one cache line, any AVX-512 load).
constexpr size_t kAlignment = 64;

// A host view of either storage type, checked.
const MatView& host_view(const MatView& v, const char* op) {
  DMUON_CHECK(v.device == DeviceKind::cpu, "cpu backend ", op, ": a view on device ", to_string(v.device));
  DMUON_CHECK(v.rows >= 0 && v.cols >= 0 && v.count >= 0 && v.ld >= v.cols, "cpu backend ", op, ": bad view ",
              v.rows, "x", v.cols, " ld ", v.ld, " count ", v.count);
  return v;
}

// A float32 host view, checked (every operation but convert computes in float32 storage).
const MatView& host_f32(const MatView& v, const char* op) {
  host_view(v, op);
  DMUON_CHECK(v.dtype == DType::f32, "cpu backend ", op, ": ", to_string(v.dtype),
              " is not supported on the CPU (float32 only; convert takes bfloat16 storage)");
  return v;
}

float* at(const MatView& v, int64_t i) { return v.f32() + i * v.batch_stride; }

// The operands of a product, all float32 or all bf16 (bf16 needs oneDNN). Returns whether they are bf16.
bool product_dtype(std::initializer_list<const MatView*> views, const char* op) {
  const DType dtype = (*views.begin())->dtype;
  for (const MatView* v : views) {
    host_view(*v, op);
    DMUON_CHECK(v->dtype == dtype, "cpu backend ", op, ": operands of ", to_string(dtype), " and ",
                to_string(v->dtype), " (all float32 or all bfloat16)");
  }
  if (dtype == DType::bf16) {
    DMUON_CHECK(cpu_bf16::available(), "cpu backend ", op,
                ": bfloat16 products need oneDNN, which this build lacks (float32 only; install libdnnl-dev)");
    return true;
  }
  for (const MatView* v : views) host_f32(*v, op);
  return false;
}

uint16_t* at16(const MatView& v, int64_t i) { return static_cast<uint16_t*>(v.data) + i * v.batch_stride; }

// x ← f(x) on every element of a host view, float32 or (with oneDNN) bf16: bf16 widened, f in float32, rounded once.
template <typename F>
void for_each_element(const MatView& x, const char* op, F f) {
  host_view(x, op);
  if (x.dtype == DType::bf16 && cpu_bf16::available()) {
    for (int64_t b = 0; b < x.count; ++b) {
      for (int64_t r = 0; r < x.rows; ++r) {
        uint16_t* row = at16(x, b) + r * x.ld;
        for (int64_t j = 0; j < x.cols; ++j) row[j] = bf16_bits(f(bf16_value(row[j]), r, j));
      }
    }
    return;
  }
  host_f32(x, op);
  for (int64_t b = 0; b < x.count; ++b) {
    for (int64_t r = 0; r < x.rows; ++r) {
      float* row = at(x, b) + r * x.ld;
      for (int64_t j = 0; j < x.cols; ++j) row[j] = f(row[j], r, j);
    }
  }
}

// Row r of matrix b of a view of either storage type.
void* row_of(const MatView& v, int64_t b, int64_t r) {
  return static_cast<char*>(v.data) + (b * v.batch_stride + r * v.ld) * static_cast<int64_t>(dtype_size(v.dtype));
}

void check_count(const MatView& a, const MatView& c, const char* op) {
  DMUON_CHECK(a.count == c.count, "cpu backend ", op, ": batches of ", a.count, " and ", c.count, " matrices");
}

class DoneEvent final : public Event {
 public:
  void wait() override {}
};

}  // namespace

std::string CpuBackend::description() const {
  return "cpu: " + linalg::cpu_model() + ", OpenBLAS " + linalg::blas_description() + ", " + cpu_bf16::description() +
         ", " + std::to_string(linalg::threads()) + " threads";
}

bool CpuBackend::supports(DType dtype) const {
  return dtype == DType::f32 || (dtype == DType::bf16 && cpu_bf16::available());
}

DType cpu_ns_default_dtype() {
  static const DType dtype = ns_default_dtype_rule(cpu_bf16::matrix_units(), std::getenv("DMUON_NS_DEFAULT_DTYPE"));
  return dtype;
}

bool cpu_ns_bf16_candidate() {
  static const bool candidate = ns_bf16_candidate_rule(cpu_bf16::native(), std::getenv("DMUON_NS_DEFAULT_DTYPE"));
  return candidate;
}

DeviceProperties CpuBackend::properties() const { return {0, "OpenBLAS", linalg::blas_description(), nullptr}; }

void* CpuBackend::allocate(size_t bytes) {
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  DMUON_CHECK(p, "cpu backend: out of host memory allocating ", bytes, " bytes");
  return p;
}

void CpuBackend::deallocate(void* p) noexcept { std::free(p); }

void CpuBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}
void CpuBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}
void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}

void CpuBackend::convert(const MatView& in, const MatView& out) {
  host_view(in, "convert");
  host_view(out, "convert");
  DMUON_CHECK(in.rows == out.rows && in.cols == out.cols && in.count == out.count, "cpu backend convert: ", in.rows,
              "x", in.cols, " into ", out.rows, "x", out.cols);
  for (int64_t b = 0; b < in.count; ++b) {
    for (int64_t r = 0; r < in.rows; ++r) {
      const void* from = row_of(in, b, r);
      void* to = row_of(out, b, r);
      if (in.dtype == out.dtype) {
        std::memmove(to, from, static_cast<size_t>(in.cols) * dtype_size(in.dtype));
      } else if (in.dtype == DType::bf16) {  // widening: exact
        for (int64_t j = 0; j < in.cols; ++j) static_cast<float*>(to)[j] = bf16_value(static_cast<const uint16_t*>(from)[j]);
      } else {  // narrowing: nearest even
        for (int64_t j = 0; j < in.cols; ++j) static_cast<uint16_t*>(to)[j] = bf16_bits(static_cast<const float*>(from)[j]);
      }
    }
  }
}

void CpuBackend::fill(const MatView& x, float value) {
  for_each_element(x, "fill", [value](float, int64_t, int64_t) { return value; });
}

void CpuBackend::gemm(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b, float beta,
                      const MatView& c) {
  const bool bf16 = product_dtype({&a, &b, &c}, "gemm");
  const int64_t m = c.rows, n = c.cols, k = trans_a ? a.rows : a.cols;
  DMUON_CHECK((trans_a ? a.cols : a.rows) == m && (trans_b ? b.cols : b.rows) == k && (trans_b ? b.rows : b.cols) == n,
              "cpu backend gemm: op(A) ", (trans_a ? a.cols : a.rows), "x", k, ", op(B) ", (trans_b ? b.cols : b.rows),
              "x", (trans_b ? b.rows : b.cols), ", C ", m, "x", n);
  check_count(a, c, "gemm");
  check_count(b, c, "gemm");
  for (int64_t i = 0; i < c.count; ++i) {
    if (bf16) {
      cpu_bf16::gemm(trans_a, trans_b, m, n, k, alpha, at16(a, i), a.ld, at16(b, i), b.ld, beta, at16(c, i), c.ld);
      continue;
    }
    linalg::gemm(trans_a, trans_b, m, n, k, alpha, at(a, i), a.ld, at(b, i), b.ld, beta, at(c, i), c.ld);
  }
}

void CpuBackend::syrk(bool trans, float alpha, const MatView& a, float beta, const MatView& c) {
  const bool bf16 = product_dtype({&a, &c}, "syrk");
  const int64_t n = trans ? a.cols : a.rows, k = trans ? a.rows : a.cols;
  DMUON_CHECK(c.rows == n && c.cols == n, "cpu backend syrk: C is ", c.rows, "x", c.cols, ", op(A) has ", n, " rows");
  check_count(a, c, "syrk");
  for (int64_t i = 0; i < c.count; ++i) {
    if (bf16) {
      cpu_bf16::syrk(trans, n, k, alpha, at16(a, i), a.ld, beta, at16(c, i), c.ld);
    } else if (trans) {
      linalg::syrk_transposed(n, k, alpha, at(a, i), a.ld, beta, at(c, i), c.ld);
    } else {
      linalg::syrk(n, k, alpha, at(a, i), a.ld, beta, at(c, i), c.ld);
    }
  }
}

void CpuBackend::symmetric_gemm(float alpha, const MatView& a, const MatView& b, float beta, const MatView& c,
                                int tiles) {
  const bool bf16 = product_dtype({&a, &b, &c}, "symmetric_gemm");
  const int64_t m = c.rows, k = a.cols;
  DMUON_CHECK(c.cols == m && a.rows == m && b.rows == k && b.cols == m, "cpu backend symmetric_gemm: A ", a.rows,
              "x", a.cols, ", B ", b.rows, "x", b.cols, ", C ", c.rows, "x", c.cols);
  check_count(a, c, "symmetric_gemm");
  check_count(b, c, "symmetric_gemm");
  for (int64_t i = 0; i < c.count; ++i) {
    if (bf16) {
      cpu_bf16::symmetric_gemm(m, k, alpha, at16(a, i), a.ld, at16(b, i), b.ld, beta, at16(c, i), c.ld, tiles);
      continue;
    }
    linalg::symmetric_gemm(m, k, alpha, at(a, i), a.ld, at(b, i), b.ld, beta, at(c, i), c.ld, tiles);
  }
}

void CpuBackend::scale(const MatView& x, float alpha) {
  if (x.dtype == DType::bf16) {
    for_each_element(x, "scale", [alpha](float v, int64_t, int64_t) { return alpha * v; });
    return;
  }
  host_f32(x, "scale");
  for (int64_t b = 0; b < x.count; ++b) {
    if (x.ld == x.cols) {
      linalg::scale(x.rows * x.cols, alpha, at(x, b));
    } else {
      for (int64_t r = 0; r < x.rows; ++r) linalg::scale(x.cols, alpha, at(x, b) + r * x.ld);
    }
  }
}

void CpuBackend::add_identity(const MatView& c, float alpha) {
  host_view(c, "add_identity");
  DMUON_CHECK(c.rows == c.cols, "cpu backend add_identity: C is ", c.rows, "x", c.cols);
  if (c.dtype == DType::bf16) {
    for_each_element(c, "add_identity", [alpha](float v, int64_t i, int64_t j) { return i == j ? v + alpha : v; });
    return;
  }
  host_f32(c, "add_identity");
  for (int64_t b = 0; b < c.count; ++b) linalg::add_identity(c.rows, alpha, at(c, b), c.ld);
}

void CpuBackend::mirror_upper(const MatView& c) {
  host_view(c, "mirror_upper");
  DMUON_CHECK(c.rows == c.cols, "cpu backend mirror_upper: C is ", c.rows, "x", c.cols);
  if (c.dtype == DType::bf16 && cpu_bf16::available()) {
    for (int64_t b = 0; b < c.count; ++b) cpu_bf16::mirror_upper(c.rows, at16(c, b), c.ld);
    return;
  }
  host_f32(c, "mirror_upper");
  for (int64_t b = 0; b < c.count; ++b) linalg::mirror_upper(c.rows, at(c, b), c.ld);
}

void CpuBackend::transpose(const MatView& in, const MatView& out) {
  host_f32(in, "transpose");
  host_f32(out, "transpose");
  DMUON_CHECK(out.rows == in.cols && out.cols == in.rows, "cpu backend transpose: ", in.rows, "x", in.cols, " into ",
              out.rows, "x", out.cols);
  check_count(in, out, "transpose");
  for (int64_t b = 0; b < in.count; ++b) {
    if (in.ld == in.cols && out.ld == out.cols) {
      linalg::transpose(in.rows, in.cols, at(in, b), at(out, b));
    } else {
      for (int64_t i = 0; i < in.rows; ++i) {
        for (int64_t j = 0; j < in.cols; ++j) at(out, b)[j * out.ld + i] = at(in, b)[i * in.ld + j];
      }
    }
  }
}

void CpuBackend::frobenius_norms(const MatView& x, double* norms) {
  host_f32(x, "frobenius_norms");
  for (int64_t b = 0; b < x.count; ++b) {
    if (x.ld == x.cols) {
      norms[b] = linalg::norm2(x.rows * x.cols, at(x, b));
    } else {
      double sum = 0;
      for (int64_t r = 0; r < x.rows; ++r) {
        const double row = linalg::norm2(x.cols, at(x, b) + r * x.ld);
        sum += row * row;
      }
      norms[b] = std::sqrt(sum);
    }
  }
}

void CpuBackend::scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps) {
  for (int64_t b = 0; b < x.count; ++b) scale(x.matrix(b), static_cast<float>(1.0 / (norms[b] * safety + eps)));
}

void CpuBackend::run(const UpdateRule& rule) {
  std::visit(
      [](const auto& r) {
        rules::checked_size(r);
        rules::run_on_cpu(r);
      },
      rule.op);
}

std::unique_ptr<Event> CpuBackend::record_event() { return std::make_unique<DoneEvent>(); }

void CpuBackend::run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) {
  if (workers <= 1) {
    fn(*this, 0);
    return;
  }
  // OpenBLAS keeps one process-wide thread count: set it to 1 here, once, before the workers start
  // (calling openblas_set_num_threads from inside them would race), and restore it after they join.
  linalg::ThreadsScope single(1);
  std::vector<std::exception_ptr> errors(workers);
  const auto work = [&](int w) {
    try {
      fn(*this, w);
    } catch (...) {
      errors[w] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) pool.emplace_back(work, w);
  work(0);  // the calling thread is worker 0
  for (auto& t : pool) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

int CpuBackend::parallelism() const { return linalg::threads(); }

int CpuBackend::set_parallelism(int n) {
  const int previous = linalg::threads();
  if (n > 0) linalg::set_threads(n);
  return previous;
}

Backend& cpu_backend() {
  // Never destroyed, like the CUDA backends: a Buffer held by a static may be freed during exit.
  static CpuBackend* backend = new CpuBackend;
  return *backend;
}

int cpu_device_count() { return 1; }

}  // namespace dmuon
