// The C ABI's CUDA calls (builds with the CUDA backend only): which device the caller's pointers are on, and
// running the engine's work on that device's backend in the caller's stream order. No CUDA types here, so the
// C ABI's main file compiles without the CUDA headers.
#pragma once

#include <functional>
#include <span>
#include <string>

#include "dmuon/backend.hpp"

namespace dmuon::capi {

// CUDA devices this process can use (0 without a driver or device; never throws).
int cuda_devices();

// The CUDA device whose memory holds every pointer (cudaPointerGetAttributes). Throws naming (name_of(i)) the first
// pointer that is host memory, unknown to CUDA, or on another device than the first.
int cuda_device_of(std::span<const void* const> pointers, const std::function<std::string(size_t)>& name_of);

// Runs `work` on device `device`'s CUDA backend so that, for the caller, it behaves as if queued on `stream`
// (a cudaStream_t; nullptr: the legacy default stream): the backend's stream first waits for an event recorded
// on `stream` (everything the caller queued before), and `stream` then waits for an event recorded on the
// backend's stream after the work, even when `work` throws partway. The host never waits, and the caller's
// allocator may reuse the memory of the arguments in `stream`'s order (PyTorch's caching allocator does), as if
// the work had run there. The thread's current device is restored before returning. Calls from several threads
// take the device's backend in turn (abi_calls.hpp: run_joined, whose order the fenced device's tests check).
void on_caller_stream(int device, void* stream, const std::function<void(Backend&)>& work);

}  // namespace dmuon::capi
