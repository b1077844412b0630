// Newton–Schulz on k same-shape matrices (DESIGN 2.6): one after another with threaded BLAS, or spread over
// worker threads that each make single-threaded BLAS calls. Every matrix runs the same single-matrix kernel
// on its own workspace, so results equal unbatched calls bit for bit.
#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>

#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "ns/workspace.hpp"

namespace dmuon {

void newton_schulz_batched(std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
                           const NsOptions& options, std::span<const std::string> names) {
  DMUON_CHECK(u.size() == o.size(), "newton_schulz_batched: ", u.size(), " inputs but ", o.size(), " outputs");
  DMUON_CHECK(names.empty() || names.size() == u.size(), "newton_schulz_batched: ", u.size(), " inputs but ",
              names.size(), " names");
  ns_detail::check_options(options);
  const size_t k = u.size();
  const auto name_of = [&](size_t i) { return names.empty() ? "batch[" + std::to_string(i) + "]" : names[i]; };

  const int threads = options.threads > 0 ? options.threads : linalg::threads();
  const size_t workers = std::min<size_t>(k, static_cast<size_t>(threads));
  if (options.batch_mode == NsBatchMode::sequential || workers <= 1) {
    linalg::ThreadsScope scope(options.threads);
    ns_detail::WorkspaceLease ws;
    for (size_t i = 0; i < k; ++i) ns_detail::orthogonalize(u[i], o[i], rows, cols, options, name_of(i), *ws);
    return;
  }

  // OpenBLAS keeps one process-wide thread count: set it to 1 here, once, before the workers start (calling
  // openblas_set_num_threads from inside them would race), and restore it after they join.
  linalg::ThreadsScope single(1);
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(k);
  const auto work = [&] {
    ns_detail::WorkspaceLease ws;
    for (size_t i = next++; i < k; i = next++) {
      try {
        ns_detail::orthogonalize(u[i], o[i], rows, cols, options, name_of(i), *ws);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(work);
  work();  // the calling thread is worker 0
  for (auto& t : pool) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace dmuon
