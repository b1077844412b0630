// A "device" for the CPU-only test machines that faults on any host access to its memory, so that the code
// which must run with its data on a GPU (sharded parameters, the distributed optimizers, Newton–Schulz) is
// checked for host dereferences on every CI run:
//   FencedBackend: every buffer is its own mmap with PROT_NONE; an operation opens (PROT_READ|WRITE) the
//     allocations its arguments point into for its duration and closes them again, then runs the CPU backend's
//     operation. host_memory() is false, so the library treats it as a GPU. A host read or write of its
//     memory anywhere else is a SIGSEGV; an operation handed host memory where it expects device memory (or
//     a copy from/to the host handed device memory on the host side) throws. run_graph behaves as the CUDA
//     backend's: the operations of a key's first call are recorded (and run), later calls with that key
//     replay the recording without calling fn, so a key that misses an address replays stale pointers.
//   FencedComm: a communicator over an MPI one, as NCCL over its bootstrap (comm_nccl.hpp): collectives on
//     fenced buffers open them, run on MPI and complete before returning; host buffers pass straight to MPI.
// Operations run where they are called (no queue), as on the CPU; the fence's bookkeeping is behind a mutex,
// so run_concurrently's workers may share one. Test-only.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/comm.hpp"

namespace dmuon::test {

// The fenced allocations and how many operations hold each open.
class Fence {
 public:
  // A byte range an operation touches.
  struct Region {
    const void* p;
    size_t bytes;
  };
  void* allocate(size_t bytes);
  void deallocate(void* p) noexcept;
  // Whether p lies in (or at the end of) a fenced allocation.
  bool owns(const void* p);
  // Opens the allocations of `regions` (empty ones ignored) until the returned scope ends; throws, naming
  // `op`, when a region is not inside one fenced allocation.
  class Scope {
   public:
    Scope(Fence& fence, std::vector<Region> regions, const char* op);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Fence& fence_;
    std::vector<char*> opened_;
  };

 private:
  struct Allocation {
    size_t size = 0;    // bytes asked for
    size_t mapped = 0;  // bytes mapped (whole pages)
    int open = 0;       // operations holding it open
  };
  std::map<char*, Allocation>::iterator find(const void* p, size_t bytes);  // end() if outside every allocation
  std::mutex mutex_;
  std::map<char*, Allocation> allocations_;  // by base address
};

class FencedBackend final : public Backend {
 public:
  explicit FencedBackend(Backend& inner = cpu_backend()) : inner_(inner) {}
  ~FencedBackend() override;

  DeviceKind device() const override { return inner_.device(); }
  std::string description() const override { return "fenced " + inner_.description(); }
  DeviceProperties properties() const override { return inner_.properties(); }
  bool supports(DType dtype) const override { return inner_.supports(dtype); }
  bool host_memory() const override { return false; }

  void* allocate(size_t bytes) override;
  void deallocate(void* p) noexcept override { fence_.deallocate(p); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void convert(const MatView& in, const MatView& out) override;
  void fill(const MatView& x, float value) override;
  void gemm(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b, float beta,
            const MatView& c) override;
  void syrk(bool trans, float alpha, const MatView& a, float beta, const MatView& c) override;
  void symmetric_gemm(float alpha, const MatView& a, const MatView& b, float beta, const MatView& c,
                      int tiles) override;
  void scale(const MatView& x, float alpha) override;
  void add_identity(const MatView& c, float alpha) override;
  void mirror_upper(const MatView& c) override;
  void transpose(const MatView& in, const MatView& out) override;
  void frobenius_norms(const MatView& x, double* norms) override;
  void scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps) override;
  void run(const UpdateRule& rule) override;  // opens the rule's views and device scalars
  void synchronize() override;
  std::unique_ptr<Event> record_event() override { return inner_.record_event(); }
  void run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) override;
  int parallelism() const override { return inner_.parallelism(); }
  int set_parallelism(int n) override { return inner_.set_parallelism(n); }
  int64_t preferred_batch() const override { return inner_.preferred_batch(); }
  void run_graph(const std::vector<int64_t>& key, const std::function<void()>& fn) override;

  Fence& fence() { return fence_; }
  int64_t graphs_recorded() const;  // distinct keys run_graph recorded
  int64_t graphs_replayed() const;  // calls of run_graph that replayed a recording
  int64_t copies_to_host() const { return copies_to_host_; }  // copy_to_host calls: a GPU's host waits

 private:
  // Runs `op` with `regions` open, and appends it to the recording when this thread records a graph.
  void run(std::vector<Fence::Region> regions, const char* name, std::function<void()> op);
  void refuse_in_graph(const char* op) const;

  Backend& inner_;
  Fence fence_;
  mutable std::mutex graphs_mutex_;
  std::map<std::vector<int64_t>, std::vector<std::function<void()>>> graphs_;
  int64_t replayed_ = 0;
  std::atomic<int64_t> copies_to_host_ = 0;
};

// The fenced world over `mpi` (a world communicator, MPI).
std::shared_ptr<comm::Comm> fenced_comm(std::shared_ptr<comm::Comm> mpi, Fence& fence);

}  // namespace dmuon::test
