// How a backend runs an update rule (dmuon/update_rules.hpp) without a list of the rules: one launcher per rule and
// backend, declared here once as a template and defined as an explicit specialization in the rule's own files
// (src/backend/rules/<rule>.cpp for the CPU, <rule>.cu for CUDA). Backends call them from std::visit over
// UpdateRule, after rules::checked_size; a launcher may take its views' sizes as equal.
#pragma once

#include "dmuon/update_rules.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st* (CUDA's driver_types.h)

namespace dmuon::rules {

// On host memory, at once.
template <class Rule>
void run_on_cpu(const Rule& rule);

// Queued on `stream` of the current device.
template <class Rule>
void run_on_cuda(const Rule& rule, CUstream_st* stream);

}  // namespace dmuon::rules

#ifdef __CUDACC__
// The grid-stride loop of a rule's kernel over i < n (launched with cuda::grid_for(n) blocks of cuda::kThreads).
#define DMUON_FOR_EACH(i, n)                                                                          \
  for (int64_t i = blockIdx.x * int64_t{::dmuon::cuda::kThreads} + threadIdx.x; i < (n);              \
       i += int64_t{gridDim.x} * ::dmuon::cuda::kThreads)
#endif
