// The fenced test device (fenced_device.hpp).
#include "fenced_device.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <numeric>
#include <tuple>
#include <variant>

#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"  // ns_release_workspaces
#include "dmuon/update_rules.hpp"

namespace dmuon::test {

namespace {

// The operations a thread is recording for run_graph (null: not recording).
thread_local std::vector<std::function<void()>>* recording = nullptr;

// The bytes a view spans, from its first element to its last.
Fence::Region region(const MatView& v) {
  if (v.empty()) return {v.data, 0};
  const int64_t elements = (v.count - 1) * v.batch_stride + (v.rows - 1) * v.ld + v.cols;
  return {v.data, static_cast<size_t>(elements) * dtype_size(v.dtype)};
}

Fence::Region doubles(const double* p, int64_t n) { return {p, sizeof(double) * static_cast<size_t>(n)}; }

void protect(char* base, size_t bytes, int prot) {
  DMUON_CHECK(mprotect(base, bytes, prot) == 0, "fenced device: mprotect failed: ", std::strerror(errno));
}

}  // namespace

// ---- Fence ----

void* Fence::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t mapped = (bytes + page - 1) / page * page;
  void* p = mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  DMUON_CHECK(p != MAP_FAILED, "fenced device: mmap of ", bytes, " bytes failed: ", std::strerror(errno));
  std::lock_guard<std::mutex> lock(mutex_);
  allocations_[static_cast<char*>(p)] = {bytes, mapped, 0};
  return p;
}

void Fence::deallocate(void* p) noexcept {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocations_.find(static_cast<char*>(p));
  if (it == allocations_.end()) return;
  munmap(it->first, it->second.mapped);
  allocations_.erase(it);
}

std::map<char*, Fence::Allocation>::iterator Fence::find(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  auto it = allocations_.upper_bound(const_cast<char*>(c));
  if (it == allocations_.begin()) return allocations_.end();
  --it;
  return c + bytes <= it->first + it->second.size ? it : allocations_.end();
}

bool Fence::owns(const void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  return find(p, 0) != allocations_.end();
}

Fence::Scope::Scope(Fence& fence, std::vector<Region> regions, const char* op) : fence_(fence) {
  std::lock_guard<std::mutex> lock(fence_.mutex_);
  for (const Region& r : regions) {
    if (r.bytes == 0) continue;
    auto it = fence_.find(r.p, r.bytes);
    if (it == fence_.allocations_.end()) {
      for (char* base : opened_) {  // undo what this scope opened, then refuse
        Allocation& a = fence_.allocations_.at(base);
        if (--a.open == 0) protect(base, a.mapped, PROT_NONE);
      }
      DMUON_FAIL("fenced device: ", op, " was given ", r.bytes, " bytes at ", r.p,
                 " that are not device (fenced) memory: host memory where the device's is expected");
    }
    if (it->second.open++ == 0) protect(it->first, it->second.mapped, PROT_READ | PROT_WRITE);
    opened_.push_back(it->first);
  }
}

Fence::Scope::~Scope() {
  std::lock_guard<std::mutex> lock(fence_.mutex_);
  for (char* base : opened_) {
    Allocation& a = fence_.allocations_.at(base);
    if (--a.open == 0) mprotect(base, a.mapped, PROT_NONE);
  }
}

// ---- FencedBackend ----

// Newton–Schulz's workspace pool keeps workspaces per backend address: freed here, while this backend can still
// deallocate them, so that a later backend at the same address does not lease this one's unmapped memory.
FencedBackend::~FencedBackend() { ns_release_workspaces(this); }

void FencedBackend::run(std::vector<Fence::Region> regions, const char* name, std::function<void()> op) {
  std::function<void()> step = [this, regions = std::move(regions), name, op = std::move(op)] {
    Fence::Scope open(fence_, regions, name);
    op();
  };
  step();
  if (recording) recording->push_back(std::move(step));
}

void FencedBackend::refuse_in_graph(const char* op) const {
  DMUON_CHECK(!recording, "fenced device: ", op, " inside run_graph (a graph cannot allocate, wait or copy "
              "from or to the host)");
}

void* FencedBackend::allocate(size_t bytes) {
  refuse_in_graph("allocate");
  return fence_.allocate(bytes);
}

void FencedBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  refuse_in_graph("copy_from_host");
  DMUON_CHECK(bytes == 0 || !fence_.owns(src), "fenced device: copy_from_host from device memory");
  run({{dst, bytes}}, "copy_from_host", [=, this] { inner_.copy_from_host(dst, src, bytes); });
}

void FencedBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  refuse_in_graph("copy_to_host");
  DMUON_CHECK(bytes == 0 || !fence_.owns(dst), "fenced device: copy_to_host into device memory");
  ++copies_to_host_;
  run({{src, bytes}}, "copy_to_host", [=, this] { inner_.copy_to_host(dst, src, bytes); });
}

void FencedBackend::copy(void* dst, const void* src, size_t bytes) {
  run({{dst, bytes}, {src, bytes}}, "copy", [=, this] { inner_.copy(dst, src, bytes); });
}

void FencedBackend::convert(const MatView& in, const MatView& out) {
  run({region(in), region(out)}, "convert", [=, this] { inner_.convert(in, out); });
}

void FencedBackend::fill(const MatView& x, float value) {
  run({region(x)}, "fill", [=, this] { inner_.fill(x, value); });
}

void FencedBackend::gemm(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b, float beta,
                         const MatView& c) {
  run({region(a), region(b), region(c)}, "gemm",
      [=, this] { inner_.gemm(trans_a, trans_b, alpha, a, b, beta, c); });
}

void FencedBackend::syrk(bool trans, float alpha, const MatView& a, float beta, const MatView& c) {
  run({region(a), region(c)}, "syrk", [=, this] { inner_.syrk(trans, alpha, a, beta, c); });
}

void FencedBackend::symmetric_gemm(float alpha, const MatView& a, const MatView& b, float beta, const MatView& c,
                                   int tiles) {
  run({region(a), region(b), region(c)}, "symmetric_gemm",
      [=, this] { inner_.symmetric_gemm(alpha, a, b, beta, c, tiles); });
}

void FencedBackend::scale(const MatView& x, float alpha) {
  run({region(x)}, "scale", [=, this] { inner_.scale(x, alpha); });
}

void FencedBackend::add_identity(const MatView& c, float alpha) {
  run({region(c)}, "add_identity", [=, this] { inner_.add_identity(c, alpha); });
}

void FencedBackend::mirror_upper(const MatView& c) {
  run({region(c)}, "mirror_upper", [=, this] { inner_.mirror_upper(c); });
}

void FencedBackend::transpose(const MatView& in, const MatView& out) {
  run({region(in), region(out)}, "transpose", [=, this] { inner_.transpose(in, out); });
}

void FencedBackend::frobenius_norms(const MatView& x, double* norms) {
  run({region(x), doubles(norms, x.count)}, "frobenius_norms", [=, this] { inner_.frobenius_norms(x, norms); });
}

void FencedBackend::scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps) {
  run({region(x), doubles(norms, x.count)}, "scale_by_inverse_norm",
      [=, this] { inner_.scale_by_inverse_norm(x, norms, safety, eps); });
}

void FencedBackend::run(const UpdateRule& rule) {
  std::visit(
      [&](const auto& r) {
        std::vector<Fence::Region> regions;
        std::apply([&](const auto&... view) { (regions.push_back({view.data(), view.size_bytes()}), ...); },
                   r.views());
        if constexpr (requires { r.scalars(); }) {
          for (const rules::DeviceScalar& s : r.scalars()) regions.push_back({s.data, s.data ? s.bytes : 0});
        }
        run(std::move(regions), r.name, [this, rule] { inner_.run(rule); });
      },
      rule.op);
}

void FencedBackend::synchronize() {
  refuse_in_graph("synchronize");
  inner_.synchronize();
}

void FencedBackend::run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) {
  // The workers' queues are the inner backend's; each worker gets this fenced backend instead.
  inner_.run_concurrently(workers, [&](Backend&, int w) { fn(*this, w); });
}

void FencedBackend::run_graph(const std::vector<int64_t>& key, const std::function<void()>& fn) {
  std::unique_lock<std::mutex> lock(graphs_mutex_);
  auto it = graphs_.find(key);
  if (it != graphs_.end()) {
    const std::vector<std::function<void()>> ops = it->second;
    ++replayed_;
    lock.unlock();
    for (const auto& op : ops) op();
    return;
  }
  lock.unlock();
  DMUON_CHECK(!recording, "fenced device: run_graph inside run_graph");
  std::vector<std::function<void()>> ops;
  recording = &ops;
  try {
    fn();
  } catch (...) {
    recording = nullptr;
    throw;
  }
  recording = nullptr;
  lock.lock();
  graphs_.emplace(key, std::move(ops));
}

int64_t FencedBackend::graphs_recorded() const {
  std::lock_guard<std::mutex> lock(graphs_mutex_);
  return static_cast<int64_t>(graphs_.size());
}

int64_t FencedBackend::graphs_replayed() const {
  std::lock_guard<std::mutex> lock(graphs_mutex_);
  return replayed_;
}

// ---- FencedComm ----

namespace {

class FencedComm final : public comm::Comm {
 public:
  FencedComm(comm::Comm& inner, Fence& fence, std::shared_ptr<comm::Comm> keep = nullptr)
      : inner_(inner), fence_(fence), keep_(std::move(keep)) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const comm::Options& options() const override { return inner_.options(); }
  Comm& node() override {
    if (!node_) node_ = std::make_unique<FencedComm>(inner_.node(), fence_);
    return *node_;
  }
  Comm& cross() override {
    if (!cross_) cross_ = std::make_unique<FencedComm>(inner_.cross(), fence_);
    return *cross_;
  }
  const comm::Topology& topology() const override { return inner_.topology(); }
  bool device_buffers() const override { return true; }

  comm::Work all_gather_raw(const void* send, int64_t count, void* recv, DType t) override {
    return route({{send, bytes(count, t)}, {recv, bytes(count * size(), t)}}, "all_gather",
                 [&] { return inner_.all_gather_raw(send, count, recv, t); });
  }
  comm::Work all_gatherv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t) override {
    return route({{send, bytes(counts[rank()], t)}, {recv, bytes(total(counts), t)}}, "all_gatherv",
                 [&] { return inner_.all_gatherv_raw(send, recv, counts, t); });
  }
  comm::Work reduce_scatterv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t,
                                 ReduceOp op) override {
    return route({{send, bytes(total(counts), t)}, {recv, bytes(counts[rank()], t)}}, "reduce_scatterv",
                 [&] { return inner_.reduce_scatterv_raw(send, recv, counts, t, op); });
  }
  comm::Work broadcast_raw(void* buf, int64_t count, DType t, int root) override {
    return route({{buf, bytes(count, t)}}, "broadcast", [&] { return inner_.broadcast_raw(buf, count, t, root); });
  }
  comm::Work all_reduce_raw(const void* send, void* recv, int64_t count, DType t,
                            ReduceOp op) override {
    return route({{send, bytes(count, t)}, {recv, bytes(count, t)}}, "all_reduce",
                 [&] { return inner_.all_reduce_raw(send, recv, count, t, op); });
  }

 private:
  static size_t bytes(int64_t count, DType t) { return static_cast<size_t>(count) * dtype_size(t); }
  static int64_t total(std::span<const int64_t> counts) {
    return std::accumulate(counts.begin(), counts.end(), int64_t{0});
  }

  // Host buffers go to MPI as they are; fenced ones are opened while MPI runs the collective to completion.
  template <typename Post>
  comm::Work route(std::vector<Fence::Region> regions, const char* what, Post&& post) {
    int fenced = 0, host = 0;
    for (const Fence::Region& r : regions)
      if (r.bytes > 0) ++(fence_.owns(r.p) ? fenced : host);
    DMUON_CHECK(fenced == 0 || host == 0, "fenced comm: ", what, " on rank ", rank(),
                " mixes host and device buffers");
    if (fenced == 0) return post();
    Fence::Scope open(fence_, std::move(regions), what);
    post().wait();
    return comm::Work();
  }

  comm::Comm& inner_;
  Fence& fence_;
  std::shared_ptr<comm::Comm> keep_;
  std::unique_ptr<FencedComm> node_, cross_;
};

}  // namespace

std::shared_ptr<comm::Comm> fenced_comm(std::shared_ptr<comm::Comm> mpi, Fence& fence) {
  comm::Comm& inner = *mpi;
  return std::make_shared<FencedComm>(inner, fence, std::move(mpi));
}

}  // namespace dmuon::test
