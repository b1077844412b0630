// Internal to src/ns: the buffers one queue's Newton–Schulz needs, pooled per backend so the hot path does not
// allocate, and the chunk kernel that the public entry points share.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/ns.hpp"

namespace dmuon::ns_detail {

// For up to `batch` matrices: two m×n and four m×m iterate buffers each (in the options' dtype), and the
// inputs' norms. Grown on demand, never shrunk while leased.
struct Workspace {
  explicit Workspace(Backend& b) : backend(&b) {}
  ~Workspace();  // its bytes leave ns_workspace_bytes()'s count
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Backend* backend;
  Buffer mn[2];
  Buffer mm[4];
  Buffer norms;  // 2·batch float32 slots holding batch doubles (backend memory is at least 8-byte aligned)
  std::vector<double> host_norms;  // their host copy, for the immediate non-finite check
  void reserve(int64_t m, int64_t n, int64_t batch, DType dtype);
  size_t bytes() const;
  double* norm_slots() const { return reinterpret_cast<double*>(norms.data()); }
};

// A workspace of `backend` taken from the process-wide pool for the lifetime of the lease, then returned, so
// repeated calls (from any thread) reuse memory that is already allocated and paged in.
class WorkspaceLease {
 public:
  explicit WorkspaceLease(Backend& backend);
  ~WorkspaceLease();
  WorkspaceLease(const WorkspaceLease&) = delete;
  WorkspaceLease& operator=(const WorkspaceLease&) = delete;
  Workspace& operator*() { return *ws_; }

 private:
  std::unique_ptr<Workspace> ws_;
};

// Checks options against the backend; throws dmuon::Error naming the bad field.
void check_options(const NsOptions& options, const Backend& backend);

// Which matrices of a batch one call takes: count of them, first, first + stride, …
struct Chunk {
  size_t first = 0, stride = 1, count = 0;
  size_t at(size_t j) const { return first + j * stride; }
};

// O_i = orth(U_i) for the matrices i of `chunk` (all rows×cols) as batched kernels on `backend`; `names[i]`
// names U_i in errors ("batch[i]" when names is empty). `norms` as newton_schulz_batched's, indexed by i
// (null: check here).
void orthogonalize_chunk(Backend& backend, std::span<const MatView> u, std::span<const MatView> o, Chunk chunk,
                         const NsOptions& options, std::span<const std::string> names, double* norms, Workspace& ws);

}  // namespace dmuon::ns_detail
