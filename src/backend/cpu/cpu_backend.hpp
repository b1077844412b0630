// The CPU backend (backend.hpp over OpenBLAS on host memory): the linalg.hpp functions behind the
// Backend interface, and for bf16 views oneDNN's products (cpu_bf16.hpp). One process-wide instance (cpu_backend()); BLAS threads are process-wide too.
#pragma once

#include "dmuon/backend.hpp"

namespace dmuon {

class CpuBackend final : public Backend {
 public:
  DeviceKind device() const override { return DeviceKind::cpu; }
  std::string description() const override;
  DeviceProperties properties() const override;
  // float32 always; bf16 (cpu_bf16.hpp) when the build has oneDNN.
  bool supports(DType dtype) const override;
  bool host_memory() const override { return true; }

  void* allocate(size_t bytes) override;
  void deallocate(void* p) noexcept override;
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

  // The rule's CPU launcher (src/backend/rules/<rule>.cpp).
  void run(const UpdateRule& rule) override;

  void synchronize() override {}
  std::unique_ptr<Event> record_event() override;
  void run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) override;
  int parallelism() const override;
  int set_parallelism(int n) override;
  int64_t preferred_batch() const override { return 1; }
};

}  // namespace dmuon
