// A backend that executes nothing and records every kernel call (DESIGN 6): the planner's cost model and the
// simulator run the real Newton–Schulz engine on it (ns.hpp: ns_kernel_calls) to get the kernel sequence, so
// they cannot drift from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"

namespace dmuon {

// One recorded call.
struct KernelCall {
  enum class Kind {
    gemm,            // C(m×n) = op(A)(m×k)·op(B)(k×n), full
    syrk,            // C(m×m) = op(A)(m×k)·op(A)ᵀ, upper triangle computed, then mirrored
    symmetric_gemm,  // C(m×m) = A(m×k)·B(k×m), tiles on and above the diagonal, then mirrored
    pass,            // an elementwise or reduction pass over memory (copy, scale, norm, …)
  };
  Kind kind = Kind::pass;
  std::string op;   // the Backend method: "gemm", "syrk", "copy", "frobenius_norms", …
  int64_t m = 0, n = 0, k = 0;
  int64_t count = 1;  // matrices in the batched call
  int tiles = 1;      // symmetric_gemm's tile count
  double flops = 0;   // flops executed, all matrices (multiply-add = 2; syrk and tiles: only what is computed)
  double full_flops = 0;  // the same products as full gemms (equal to flops for gemm and passes)
  double bytes = 0;   // bytes a pass reads plus writes (products: 0)
};

class RecordingBackend final : public Backend {
 public:
  // preferred_batch: how many matrices of a batch the engine should put in one call (1 as on the CPU, or a
  // GPU's whole batch).
  explicit RecordingBackend(int64_t preferred_batch = 1) : preferred_batch_(preferred_batch) {}

  const std::vector<KernelCall>& calls() const { return calls_; }
  void clear() { calls_.clear(); }

  DeviceKind device() const override { return DeviceKind::record; }
  std::string description() const override { return "record (executes nothing)"; }
  DeviceProperties properties() const override { return {0, "record", "", nullptr}; }
  bool supports(DType dtype) const override { return dtype == DType::f32 || dtype == DType::bf16; }
  bool host_memory() const override { return false; }

  void* allocate(size_t bytes) override;  // an address that is never dereferenced
  void deallocate(void*) noexcept override {}
  void copy_from_host(void*, const void*, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;  // writes zeros: every norm reads 0
  void copy(void*, const void*, size_t bytes) override;
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

  // A pass named rule.name over its views' bytes: a read-only view once, a written one twice (read and written).
  void run(const UpdateRule& rule) override;

  void synchronize() override {}
  std::unique_ptr<Event> record_event() override;
  void run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) override;
  int parallelism() const override { return 1; }
  int set_parallelism(int) override { return 1; }
  int64_t preferred_batch() const override { return preferred_batch_; }

 private:
  void pass(const std::string& op, int64_t count, double bytes);
  std::vector<KernelCall> calls_;
  int64_t preferred_batch_;
  uintptr_t next_address_ = 4096;
};

}  // namespace dmuon
