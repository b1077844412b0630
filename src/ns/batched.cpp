// Newton–Schulz on k same-shape matrices (DESIGN 2.6): on one queue, in chunks of the backend's preferred
// batch, or spread over several queues (CPU: worker threads making single-threaded BLAS calls). Every matrix
// runs the same kernels whatever its chunk, so results equal unbatched calls bit for bit.
#include <algorithm>
#include <exception>

#include "dmuon/error.hpp"
#include "ns/workspace.hpp"

namespace dmuon {

namespace {

void check_views(std::span<const MatView> u, std::span<const MatView> o, const Backend& backend) {
  DMUON_CHECK(u.size() == o.size(), "newton_schulz_batched: ", u.size(), " inputs but ", o.size(), " outputs");
  for (size_t i = 0; i < u.size(); ++i) {
    for (const MatView* v : {&u[i], &o[i]}) {
      DMUON_CHECK(v->rows == u[0].rows && v->cols == u[0].cols && v->count == 1, "newton_schulz_batched: matrix ", i,
                  " is ", v->count, "x", v->rows, "x", v->cols, ", matrix 0 is ", u[0].rows, "x", u[0].cols);
      DMUON_CHECK(v->rows >= 0 && v->cols >= 0, "Newton-Schulz input has a negative shape ", v->rows, "x", v->cols);
      DMUON_CHECK(v->device == backend.device() && v->dtype == DType::f32 && v->ld == v->cols,
                  "newton_schulz_batched: matrix ", i, " must be a contiguous float32 view on ",
                  to_string(backend.device()), " (it is ", to_string(v->dtype), " on ", to_string(v->device), ")");
    }
  }
}

// The matrices first, first + stride, … below k on one queue, in chunks of the queue's preferred batch. Errors
// are kept per chunk in `errors` (indexed by the chunk's first matrix) when given, else thrown.
void run_queue(Backend& queue, size_t first, size_t stride, std::span<const MatView> u, std::span<const MatView> o,
               const NsOptions& options, std::span<const std::string> names, double* norms,
               std::vector<std::exception_ptr>* errors) {
  ns_detail::WorkspaceLease ws(queue);
  const size_t per_call = static_cast<size_t>(std::max<int64_t>(1, queue.preferred_batch()));
  const size_t mine = first < u.size() ? (u.size() - first + stride - 1) / stride : 0;
  for (size_t j = 0; j < mine; j += per_call) {
    const ns_detail::Chunk chunk{first + j * stride, stride, std::min(per_call, mine - j)};
    try {
      ns_detail::orthogonalize_chunk(queue, u, o, chunk, options, names, norms, *ws);
    } catch (...) {
      if (!errors) throw;
      (*errors)[chunk.first] = std::current_exception();
    }
  }
}

}  // namespace

void newton_schulz_batched(Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
                           const NsOptions& options, std::span<const std::string> names, double* norms) {
  check_views(u, o, backend);
  DMUON_CHECK(names.empty() || names.size() == u.size(), "newton_schulz_batched: ", u.size(), " inputs but ",
              names.size(), " names");
  ns_detail::check_options(options, backend);
  const size_t k = u.size();
  if (k == 0 || u[0].empty()) return;

  const int threads = options.threads > 0 ? options.threads : backend.parallelism();
  const size_t workers = std::min<size_t>(k, static_cast<size_t>(threads));
  if (options.batch_mode == NsBatchMode::sequential || workers <= 1) {
    ParallelismScope scope(backend, options.threads);
    run_queue(backend, 0, 1, u, o, options, names, norms, nullptr);
    return;
  }
  // Worker w takes matrices w, w + workers, …: same-shape matrices cost the same, so a static split balances.
  std::vector<std::exception_ptr> errors(k);
  backend.run_concurrently(static_cast<int>(workers), [&](Backend& queue, int w) {
    run_queue(queue, static_cast<size_t>(w), workers, u, o, options, names, norms, &errors);
  });
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void newton_schulz_batched(std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
                           const NsOptions& options, std::span<const std::string> names) {
  DMUON_CHECK(u.size() == o.size(), "newton_schulz_batched: ", u.size(), " inputs but ", o.size(), " outputs");
  DMUON_CHECK(rows >= 0 && cols >= 0, "Newton-Schulz input has a negative shape ", rows, "x", cols);
  std::vector<MatView> uv, ov;
  for (size_t i = 0; i < u.size(); ++i) {
    uv.push_back(f32_view(DeviceKind::cpu, const_cast<float*>(u[i]), rows, cols));
    ov.push_back(f32_view(DeviceKind::cpu, o[i], rows, cols));
  }
  newton_schulz_batched(cpu_backend(), uv, ov, options, names);
}

void newton_schulz(const float* u, float* o, int64_t rows, int64_t cols, const NsOptions& options,
                   const std::string& name) {
  newton_schulz_batched(std::span<const float* const>(&u, 1), std::span<float* const>(&o, 1), rows, cols, options,
                        std::span<const std::string>(&name, 1));
}

Orthogonalizer ns_orthogonalizer(const NsOptions& options) {
  return [options](Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
                   std::span<const std::string> names, double* norms) {
    newton_schulz_batched(backend, u, o, options, names, norms);
  };
}

}  // namespace dmuon
