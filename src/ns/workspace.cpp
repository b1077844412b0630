// The Newton–Schulz workspace pool (workspace.hpp, ns.hpp's limit): leased per queue, kept for reuse up to a
// byte limit, released on request.
#include <cstdlib>
#include <mutex>

#include "ns/workspace.hpp"

namespace dmuon {
namespace ns_detail {

namespace {

// Every workspace's bytes (pooled and leased, every backend) and their most since the last reset, counted where
// their buffers are allocated and freed: ns_workspace_bytes().
MemoryCounter workspaces;

size_t bytes_of(const Buffer& b) { return static_cast<size_t>(b.size()) * dtype_size(b.dtype()); }

// A grown buffer is allocated before the old one is freed: both count at that moment.
void grow(Buffer& b, Backend& backend, int64_t size, DType dtype) {
  if (b.size() < size || b.dtype() != dtype) {
    Buffer bigger(backend, dtype, size);
    workspaces.allocated(bytes_of(bigger));
    workspaces.freed(bytes_of(b));
    b = std::move(bigger);
  }
}

size_t default_limit() {
  const char* mb = std::getenv("DMUON_NS_WORKSPACE_MB");
  return (mb && *mb ? std::strtoull(mb, nullptr, 10) : 1024) << 20;
}

struct Pool {
  std::mutex mutex;
  std::vector<std::unique_ptr<Workspace>> free;  // oldest first
  size_t limit = default_limit();

  size_t bytes() const {
    size_t total = 0;
    for (const auto& ws : free) total += ws->bytes();
    return total;
  }
  // Whether `ws` is its backend's largest pooled workspace (of equal ones, the newest).
  bool largest_of_its_backend(const Workspace& ws) const {
    const Workspace* largest = nullptr;
    for (const auto& other : free)
      if (other->backend == ws.backend && (largest == nullptr || other->bytes() >= largest->bytes()))
        largest = other.get();
    return largest == &ws;
  }
  // Frees the oldest workspaces until the pool holds at most `limit` bytes, but never a backend's largest: one
  // batch of a large model (qwen2.5-0.5b's 48 MLP matrices need 1.1 GB in bf16) may need more than the limit,
  // and freeing it would allocate it again on every call, at new addresses (a GPU then records new graphs).
  // ns_release_workspaces frees those.
  void trim() {
    for (auto it = free.begin(); it != free.end() && bytes() > limit;) {
      if (largest_of_its_backend(**it)) {
        ++it;
      } else {
        it = free.erase(it);
      }
    }
  }
};

// Never destroyed: its workspaces hold buffers of backends that outlive every static destructor (a CUDA
// backend's memory cannot be freed once the runtime has shut down at exit).
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

void Workspace::reserve(int64_t m, int64_t n, int64_t batch, DType dtype) {
  for (Buffer& b : mn) grow(b, *backend, m * n * batch, dtype);
  for (Buffer& b : mm) grow(b, *backend, m * m * batch, dtype);
  grow(norms, *backend, 2 * batch, DType::f32);
}

Workspace::~Workspace() { workspaces.freed(bytes()); }

size_t Workspace::bytes() const {
  size_t total = bytes_of(norms);
  for (const Buffer& b : mn) total += bytes_of(b);
  for (const Buffer& b : mm) total += bytes_of(b);
  return total;
}

WorkspaceLease::WorkspaceLease(Backend& backend) {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  for (auto it = p.free.rbegin(); it != p.free.rend(); ++it) {
    if ((*it)->backend == &backend) {
      ws_ = std::move(*it);
      p.free.erase(std::next(it).base());
      return;
    }
  }
  ws_ = std::make_unique<Workspace>(backend);
}

WorkspaceLease::~WorkspaceLease() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.free.push_back(std::move(ws_));
  p.trim();
}

}  // namespace ns_detail

void ns_set_workspace_limit(size_t bytes) {
  auto& p = ns_detail::pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.limit = bytes;
  p.trim();
}

void ns_release_workspaces(const Backend* backend) {
  auto& p = ns_detail::pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  std::erase_if(p.free, [&](const auto& ws) { return !backend || ws->backend == backend; });
}

size_t ns_pooled_workspace_bytes() {
  auto& p = ns_detail::pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return p.bytes();
}

MemoryCount ns_workspace_bytes(bool reset_peak) { return ns_detail::workspaces.read(reset_peak); }

}  // namespace dmuon
