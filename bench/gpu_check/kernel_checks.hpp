// The essential GPU checks of cuda_backend_test and backend_conformance_test, against host loops in plain C++, for
// the GPU-only build (no CPU backend, no GoogleTest): elementwise kernels on strided, padded batches in float32
// and bfloat16, the update rules bit for bit with their host loops (src/backend/rules/), reductions against
// float64, products with an empty inner dimension, CUDA graphs recorded once and replayed and their cache's eviction,
// run_concurrently's stream order, and the runtime's error state after a refused capture and a not-ready event
// query.
#pragma once

#include "check_log.hpp"
#include "dmuon/backend.hpp"

namespace dmuon {

void check_kernels(Backend& gpu, CheckLog& log);

}  // namespace dmuon
