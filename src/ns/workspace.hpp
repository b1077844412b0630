// Internal to src/ns: the buffers one Newton–Schulz run needs, pooled so the hot path does not allocate, and
// the single-matrix kernel that the public entry points and the batched runner share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/ns.hpp"

namespace dmuon::ns_detail {

// Two m×n and four m×m float buffers; grown, never shrunk.
struct Workspace {
  std::vector<float> mn[2];
  std::vector<float> mm[4];
  void reserve(int64_t m, int64_t n);
};

// A workspace taken from a process-wide pool for the lifetime of the lease, then returned, so repeated calls
// (from any thread) reuse memory that is already allocated and paged in.
class WorkspaceLease {
 public:
  WorkspaceLease();
  ~WorkspaceLease();
  WorkspaceLease(const WorkspaceLease&) = delete;
  WorkspaceLease& operator=(const WorkspaceLease&) = delete;
  Workspace& operator*() { return *ws_; }

 private:
  std::unique_ptr<Workspace> ws_;
};

// Checks options; throws dmuon::Error naming the bad field.
void check_options(const NsOptions& options);

// O = orth(U) for one matrix with the current BLAS thread setting (see newton_schulz).
void orthogonalize(const float* u, float* o, int64_t rows, int64_t cols, const NsOptions& options,
                   const std::string& name, Workspace& ws);

}  // namespace dmuon::ns_detail
