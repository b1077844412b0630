// The recording backend (backend_record.hpp): every call becomes a KernelCall with its shape, flops and bytes;
// nothing runs and no memory is touched.
#include "dmuon/backend_record.hpp"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <variant>

#include "dmuon/error.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon {

namespace {

class DoneEvent final : public Event {
 public:
  void wait() override {}
};

double bytes_of(const MatView& v) {
  return static_cast<double>(v.count) * static_cast<double>(v.elements()) * static_cast<double>(dtype_size(v.dtype));
}

// What an update rule's view moves: a read-only view is read once, a written one read and written.
template <typename T>
double view_bytes(const DeviceSpan<T>& view) {
  return (std::is_const_v<T> ? 1.0 : 2.0) * static_cast<double>(view.size_bytes());
}

}  // namespace

void* RecordingBackend::allocate(size_t bytes) {
  const uintptr_t at = next_address_;
  next_address_ += (bytes + 63) / 64 * 64 + 64;
  return reinterpret_cast<void*>(at);
}

void RecordingBackend::pass(const std::string& op, int64_t count, double bytes) {
  KernelCall c;
  c.kind = KernelCall::Kind::pass;
  c.op = op;
  c.count = count;
  c.bytes = bytes;
  calls_.push_back(c);
}

void RecordingBackend::copy_from_host(void*, const void*, size_t bytes) { pass("copy_from_host", 1, double(bytes)); }
void RecordingBackend::copy_to_host(void* dst, const void*, size_t bytes) {
  std::memset(dst, 0, bytes);
  pass("copy_to_host", 1, double(bytes));
}
void RecordingBackend::copy(void*, const void*, size_t bytes) { pass("copy", 1, 2.0 * double(bytes)); }
void RecordingBackend::convert(const MatView& in, const MatView& out) {
  pass("convert", in.count, bytes_of(in) + bytes_of(out));
}
void RecordingBackend::fill(const MatView& x, float) { pass("fill", x.count, bytes_of(x)); }

void RecordingBackend::gemm(bool trans_a, bool, float, const MatView& a, const MatView&, float beta,
                            const MatView& c) {
  KernelCall call;
  call.kind = KernelCall::Kind::gemm;
  call.op = "gemm";
  call.m = c.rows, call.n = c.cols, call.k = trans_a ? a.rows : a.cols;
  call.count = c.count;
  call.flops = call.full_flops = 2.0 * double(call.m) * double(call.n) * double(call.k) * double(c.count);
  (void)beta;
  calls_.push_back(call);
}

void RecordingBackend::syrk(bool trans, float, const MatView& a, float, const MatView& c) {
  KernelCall call;
  call.kind = KernelCall::Kind::syrk;
  call.op = "syrk";
  call.m = call.n = c.rows;
  call.k = trans ? a.rows : a.cols;
  call.count = c.count;
  const double m = double(call.m), k = double(call.k);
  call.flops = m * (m + 1) * k * double(c.count);  // the upper triangle and the diagonal
  call.full_flops = 2 * m * m * k * double(c.count);
  calls_.push_back(call);
}

void RecordingBackend::symmetric_gemm(float, const MatView& a, const MatView&, float, const MatView& c, int tiles) {
  DMUON_CHECK(tiles >= 1, "symmetric_gemm: tile count must be at least 1, got ", tiles);
  KernelCall call;
  call.kind = KernelCall::Kind::symmetric_gemm;
  call.op = "symmetric_gemm";
  call.m = call.n = c.rows;
  call.k = a.cols;
  call.count = c.count;
  call.tiles = tiles;
  // The CPU backend's tiling (src/backend/cpu/symmetric.cpp): block row i covers rows [lo, hi) and columns [lo, m).
  const int64_t m = call.m, t = std::max<int64_t>(1, std::min<int64_t>(tiles, m));
  double flops = 0;
  for (int64_t i = 0; i < t; ++i) {
    const int64_t lo = m * i / t, hi = m * (i + 1) / t;
    flops += 2.0 * double(hi - lo) * double(m - lo) * double(call.k);
  }
  call.flops = flops * double(c.count);
  call.full_flops = 2.0 * double(m) * double(m) * double(call.k) * double(c.count);
  calls_.push_back(call);
}

void RecordingBackend::scale(const MatView& x, float) { pass("scale", x.count, 2 * bytes_of(x)); }
void RecordingBackend::add_identity(const MatView& c, float) {
  pass("add_identity", c.count, 2.0 * double(c.rows) * double(c.count) * double(dtype_size(c.dtype)));
}
void RecordingBackend::mirror_upper(const MatView& c) { pass("mirror_upper", c.count, bytes_of(c)); }
void RecordingBackend::transpose(const MatView& in, const MatView& out) {
  pass("transpose", in.count, bytes_of(in) + bytes_of(out));
}
void RecordingBackend::frobenius_norms(const MatView& x, double*) { pass("frobenius_norms", x.count, bytes_of(x)); }
void RecordingBackend::scale_by_inverse_norm(const MatView& x, const double*, double, double) {
  pass("scale_by_inverse_norm", x.count, 2 * bytes_of(x));
}

void RecordingBackend::run(const UpdateRule& rule) {
  std::visit(
      [&](const auto& r) {
        double bytes = 0;
        std::apply([&](const auto&... view) { ((bytes += view_bytes(view)), ...); }, r.views());
        pass(r.name, 1, bytes);
      },
      rule.op);
}

std::unique_ptr<Event> RecordingBackend::record_event() { return std::make_unique<DoneEvent>(); }

void RecordingBackend::run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) {
  for (int w = 0; w < std::max(1, workers); ++w) fn(*this, w);
}

}  // namespace dmuon
