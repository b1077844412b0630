// Timing work on a backend's queue, for the autotuner and the benchmarks: on a GPU with CUDA events around the
// queued work (the host clock would time the queueing, not the work), elsewhere with the wall clock around the
// work and synchronize().
#pragma once

#include <functional>

#include "dmuon/backend.hpp"

namespace dmuon {

// Seconds the work that `enqueue` queues on `backend` takes.
double time_on(Backend& backend, const std::function<void()>& enqueue);

}  // namespace dmuon
