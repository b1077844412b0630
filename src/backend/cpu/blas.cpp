#include <cblas.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <string>

#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"

namespace dmuon::linalg {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void set_threads(int n) {
  DMUON_CHECK(n >= 1, "BLAS thread count must be at least 1, got ", n);
  openblas_set_num_threads(n);
}

int threads() { return openblas_get_num_threads(); }

ThreadsScope::ThreadsScope(int n) : previous_(threads()) {
  if (n > 0 && n != previous_) set_threads(n);
}

ThreadsScope::~ThreadsScope() {
  if (threads() != previous_) openblas_set_num_threads(previous_);
}

std::string blas_description() {
  std::string config = openblas_get_config();
  std::string version = OPENBLAS_VERSION;
  auto trim = [](std::string s) {
    s.erase(0, s.find_first_not_of(' '));
    s.erase(s.find_last_not_of(' ') + 1);
    return s;
  };
  return trim(version) + " (" + trim(config) + ")";
}

bool cpu_has_avx512() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

std::string blas_kernel_advice() {
#if defined(__x86_64__)
  const bool avx512 = cpu_has_avx512();
  const std::string core = openblas_get_corename();
  std::string lower = core;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  static const std::array<const char*, 3> avx512_cores = {"skylakex", "cooperlake", "sapphirerapids"};
  if (!avx512 || std::find(avx512_cores.begin(), avx512_cores.end(), lower) != avx512_cores.end()) return {};
  return "OpenBLAS runs its " + core + " kernels on this CPU, which has AVX-512 (this OpenBLAS does not know its " +
         "model): its float32 products run several times slower than they can; start the process with " +
         "OPENBLAS_CORETYPE=SkylakeX";
#else
  return {};
#endif
}

}  // namespace dmuon::linalg
