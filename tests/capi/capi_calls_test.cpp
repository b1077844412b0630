// The C ABI's work on a backend (src/capi/abi_calls.hpp), which dmuon_ns_run, dmuon_adamw_step and the Muon update
// calls run on the CPU and on a GPU (inside the caller's stream order):
//  - called the way dmuon.torch calls it (one contiguous (k, rows, cols) stack per bucket, pointers into it,
//    in place; AdamW on whole tensors), on the fenced test device, whose memory faults on any host access, it
//    equals the CPU call bit for bit, for float32 and bfloat16 storage: the device path touches the caller's
//    data only through backend operations (what a CUDA backend needs);
//  - bfloat16 Newton–Schulz on the CPU is the float32 engine on the widened input, rounded once, and within the
//    derived bound of float64 Newton–Schulz.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <future>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backend/bf16.hpp"
#include "capi/abi_calls.hpp"
#include "dmuon/backend_record.hpp"
#include "dmuon/optim.hpp"
#include "fenced_device.hpp"
#include "ns_reference.hpp"

namespace dmuon {
namespace {

// k rows×cols matrices in `storage`, back to back, as host bytes.
std::vector<char> random_stack(DType storage, int64_t k, int64_t rows, int64_t cols, uint32_t seed, float scale = 1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  const int64_t n = k * rows * cols;
  std::vector<char> bytes(static_cast<size_t>(n) * dtype_size(storage));
  for (int64_t i = 0; i < n; ++i) {
    const float x = normal(rng);
    if (storage == DType::f32) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else {
      const uint16_t b = bf16_bits(x);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
  }
  return bytes;
}

float value_at(const std::vector<char>& bytes, DType storage, int64_t i) {
  if (storage == DType::f32) {
    float x;
    std::memcpy(&x, bytes.data() + 4 * i, 4);
    return x;
  }
  uint16_t b;
  std::memcpy(&b, bytes.data() + 2 * i, 2);
  return bf16_value(b);
}

// Pointers to the k matrices of a stack at `base`, as dmuon.torch makes them (data_ptr + j·rows·cols·size).
std::vector<void*> matrix_pointers(void* base, DType storage, int64_t k, int64_t rows, int64_t cols) {
  std::vector<void*> out;
  for (int64_t j = 0; j < k; ++j)
    out.push_back(static_cast<char*>(base) + j * rows * cols * static_cast<int64_t>(dtype_size(storage)));
  return out;
}

// Newton–Schulz in place on a host stack, through ns_run on `backend`: the stack is copied into the backend's
// memory (the fenced device's, or left where it is on the CPU) and back.
std::vector<char> ns_on(Backend& backend, std::vector<char> stack, DType storage, int64_t k, int64_t rows,
                        int64_t cols, const NsOptions& options) {
  capi::Staging staging;
  const std::vector<std::string> names(k, "bucket matrix");
  if (backend.host_memory()) {
    const auto ptrs = matrix_pointers(stack.data(), storage, k, rows, cols);
    capi::ns_run(backend, storage, {ptrs.data(), ptrs.size()}, ptrs, rows, cols, options, names, staging);
    return stack;
  }
  void* device = backend.allocate(stack.size());
  backend.copy_from_host(device, stack.data(), stack.size());
  const auto ptrs = matrix_pointers(device, storage, k, rows, cols);
  capi::ns_run(backend, storage, {ptrs.data(), ptrs.size()}, ptrs, rows, cols, options, names, staging);
  backend.copy_to_host(stack.data(), device, stack.size());
  backend.deallocate(device);
  return stack;
}

TEST(CapiCalls, NewtonSchulzOnTheFencedDeviceEqualsTheCpuBitForBit) {
  test::FencedBackend fenced;
  for (DType storage : {DType::f32, DType::bf16}) {
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{24, 64}, {64, 24}, {32, 32}}) {
      for (NsAlgo algo : {NsAlgo::standard, NsAlgo::gram}) {
        NsOptions options;
        options.algo = algo;
        const std::vector<char> stack = random_stack(storage, 3, rows, cols, 7 + rows);
        const std::vector<char> cpu = ns_on(cpu_backend(), stack, storage, 3, rows, cols, options);
        const std::vector<char> device = ns_on(fenced, stack, storage, 3, rows, cols, options);
        EXPECT_NE(cpu, stack);
        EXPECT_EQ(device, cpu) << to_string(storage) << " " << rows << "x" << cols << " " << to_string(algo);
      }
    }
  }
}

// Unchecked (check_finite false, as dmuon.torch.DMuon calls it), Newton–Schulz on a device reads nothing back, so
// on a GPU the host does not wait for the caller's stream; checked, it reads the norms back. Both give the same bits.
TEST(CapiCalls, UncheckedNewtonSchulzReadsNothingBackAndEqualsChecked) {
  test::FencedBackend fenced;
  const int64_t k = 3, rows = 24, cols = 64;
  for (DType storage : {DType::f32, DType::bf16}) {
    const std::vector<char> stack = random_stack(storage, k, rows, cols, 5);
    std::vector<char> results[2];
    for (bool check : {true, false}) {
      capi::Staging staging;
      void* device = fenced.allocate(stack.size());
      fenced.copy_from_host(device, stack.data(), stack.size());
      const auto ptrs = matrix_pointers(device, storage, k, rows, cols);
      const int64_t before = fenced.copies_to_host();
      capi::ns_run(fenced, storage, {ptrs.data(), ptrs.size()}, ptrs, rows, cols, NsOptions{}, {}, staging, check);
      EXPECT_EQ(fenced.copies_to_host() > before, check) << to_string(storage) << " check " << check;
      results[check].resize(stack.size());
      fenced.copy_to_host(results[check].data(), device, stack.size());
      fenced.deallocate(device);
    }
    EXPECT_NE(results[0], stack);
    EXPECT_EQ(results[0], results[1]) << to_string(storage);
  }
}

// hold: threads that call the C ABI at once take one device backend in turn (on_caller_stream holds it for the whole
// call), while other backends stay free.
TEST(CapiCalls, OneCallAtATimeHoldsABackend) {
  test::FencedBackend shared, other;
  std::atomic<int> inside = 0, most = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        const auto held = capi::hold(shared);
        const int now = ++inside;
        for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);) {
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));  // a window for an overlap to show
        --inside;
      }
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(most.load(), 1);
  const auto held = capi::hold(shared);
  EXPECT_TRUE(std::async(std::launch::async, [&] { return capi::hold(other).owns_lock(); }).get());
}

// The caller's stream, modelled: operations queued on it run only when something waits for them (the backend's
// queue, in backend_waits_for_caller) or at the end.
struct CallerQueue {
  std::vector<std::function<void()>> queued;
  void run_queued() {
    for (auto& op : queued) op();
    queued.clear();
  }
};

// run_joined, the C ABI's join of the caller's stream (on_caller_stream's on a GPU), on the fenced device: the work
// sees what the caller queued before the call, what the caller queues after the call sees the work's results, and
// both hold after the work throws, with the backend held throughout.
TEST(CapiCalls, TheCallerStreamJoinOrdersBothWaysAlsoAfterAThrow) {
  test::FencedBackend fenced;
  for (bool throws : {false, true}) {
    Buffer x(fenced, DType::f32, 4), y(fenced, DType::f32, 4), z(fenced, DType::f32, 4);
    fenced.fill(x.view(1, 4), 1.0f);
    fenced.fill(y.view(1, 4), -1.0f);
    CallerQueue caller;
    caller.queued.push_back([&] { fenced.fill(x.view(1, 4), 3.0f); });  // queued before the call
    std::vector<std::string> order;
    bool held_during_work = false;
    std::promise<void> other_holds;
    std::future<void> other;  // another thread's call on the same backend, started during the work
    const capi::QueueJoin join{[&] {
                                 order.push_back("backend waits");
                                 caller.run_queued();
                               },
                               [&] {
                                 order.push_back("caller waits");
                                 // queued after the call: it reads the work's result, once the join has ordered it
                                 caller.queued.push_back([&] { fenced.copy(z.data(), y.data(), 4 * sizeof(float)); });
                               }};
    const auto work = [&](Backend& b) {
      order.push_back("work");
      b.copy(y.data(), x.data(), 4 * sizeof(float));
      b.scale(y.view(1, 4), 2.0f);
      other = std::async(std::launch::async, [&] {
        const auto other_held = capi::hold(fenced);
        other_holds.set_value();
      });
      // A window for the other call to get in, which it must not while this call holds the backend.
      const auto window = other_holds.get_future().wait_for(std::chrono::milliseconds(50));
      held_during_work = window == std::future_status::timeout;
      if (throws) throw Error("the work failed");
    };
    if (throws) {
      EXPECT_THROW(capi::run_joined(fenced, join, work), Error);
    } else {
      capi::run_joined(fenced, join, work);
    }
    caller.run_queued();
    other.get();  // released after the call
    EXPECT_EQ(order, (std::vector<std::string>{"backend waits", "work", "caller waits"})) << "throws " << throws;
    EXPECT_TRUE(held_during_work) << "throws " << throws;
    std::vector<float> got(4);
    z.download(got);
    EXPECT_EQ(got, std::vector<float>(4, 6.0f)) << "throws " << throws;  // 2·3: the caller's fill, then the work
  }
}

// p, grad, m, v of n values in `storage` after `steps` AdamW steps through adamw_run on `backend`.
std::vector<std::vector<char>> adamw_on(Backend& backend, DType storage, int64_t n, int steps) {
  std::vector<std::vector<char>> arrays = {random_stack(storage, 1, 1, n, 1), random_stack(storage, 1, 1, n, 2, 1e-2f),
                                           std::vector<char>(n * dtype_size(storage), 0),
                                           std::vector<char>(n * dtype_size(storage), 0)};
  std::vector<void*> at(4);
  for (int r = 0; r < 4; ++r) {
    at[r] = arrays[r].data();
    if (!backend.host_memory()) {
      at[r] = backend.allocate(arrays[r].size());
      backend.copy_from_host(at[r], arrays[r].data(), arrays[r].size());
    }
  }
  capi::Staging staging;
  const AdamWHyper hyper{1e-2, 0.9, 0.999, 1e-8, 0.1};
  for (int t = 1; t <= steps; ++t)
    capi::adamw_run(backend, storage, at[0], at[1], at[2], at[3], n, adamw_step_constants(hyper, t), 0.5f, staging);
  if (!backend.host_memory()) {
    for (int r = 0; r < 4; ++r) {
      backend.copy_to_host(arrays[r].data(), at[r], arrays[r].size());
      backend.deallocate(at[r]);
    }
  }
  return arrays;
}

// n spans more than one of the CPU's staged passes (2^16 values), and the fenced device stages all at once.
TEST(CapiCalls, AdamWOnTheFencedDeviceEqualsTheCpuBitForBit) {
  test::FencedBackend fenced;
  const int64_t n = (int64_t{1} << 16) + 1000;
  for (DType storage : {DType::f32, DType::bf16}) {
    const auto cpu = adamw_on(cpu_backend(), storage, n, 3);
    const auto device = adamw_on(fenced, storage, n, 3);
    const char* names[] = {"p", "grad", "exp_avg", "exp_avg_sq"};
    for (int r = 0; r < 4; ++r) EXPECT_EQ(device[r], cpu[r]) << to_string(storage) << " " << names[r];
  }
}

// Muon's whole update of a bucket held here (muon_update_run, what dmuon_muon_update runs), called the way
// dmuon.torch calls it: k matrices' gradients, momenta and weights in `storage`, a keep flag per matrix and the
// clipping factor in the backend's memory; the second matrix has no gradient (a zero one), the third is kept out
// (keep = 0). Returns {momenta, weights, the weights before} after `steps` updates as host bytes; `reads` (may be
// empty) counts the backend's copies to the host, whose number during the updates goes to *read_back.
std::vector<std::vector<char>> muon_update_on(Backend& backend, DType storage, int64_t k, int64_t rows, int64_t cols,
                                              int steps, const std::function<int64_t()>& reads = {},
                                              int64_t* read_back = nullptr) {
  const size_t bytes = static_cast<size_t>(k * rows * cols) * dtype_size(storage);
  const std::vector<std::vector<char>> host = {random_stack(storage, k, rows, cols, 11),
                                               random_stack(storage, k, rows, cols, 12, 0.1f),
                                               random_stack(storage, k, rows, cols, 13)};  // grads, momenta, weights
  const std::vector<float> flags = {1, 1, 0, 0.5f};  // keep per matrix, then the clipping factor
  std::vector<void*> device(3);
  for (int r = 0; r < 3; ++r) {
    device[r] = backend.allocate(bytes);
    backend.copy_from_host(device[r], host[r].data(), bytes);
  }
  auto* scalars = static_cast<float*>(backend.allocate(flags.size() * sizeof(float)));
  backend.copy_from_host(scalars, flags.data(), flags.size() * sizeof(float));
  const auto grads = matrix_pointers(device[0], storage, k, rows, cols);
  const auto momenta = matrix_pointers(device[1], storage, k, rows, cols);
  const auto weights = matrix_pointers(device[2], storage, k, rows, cols);
  std::vector<capi::Operand> g, m, w;
  std::vector<const float*> keep;
  for (int64_t j = 0; j < k; ++j) {
    g.push_back({j == 1 ? nullptr : grads[j], storage});
    m.push_back({momenta[j], storage});
    w.push_back({weights[j], storage});
    keep.push_back(scalars + std::min<int64_t>(j, 2));
  }
  const capi::StepFlags step{keep, scalars + 3};
  capi::Staging staging;
  const std::vector<std::string> names(k, "bucket matrix");
  // The update's default compute dtype (untuned: the device's).
  const NsOptions options = capi::call_ns_options(backend, {}, NsOptions{}, std::nullopt, DType::bf16, rows, cols, k);
  const int64_t before = reads ? reads() : 0;
  for (int s = 0; s < steps; ++s)
    capi::muon_update_run(backend, rows, cols, g, m, w, step, 0.95, true, 0.02, 0.1, 0.2 * std::sqrt(double(cols)),
                          false, options, names, staging, false);
  if (read_back) *read_back = reads() - before;
  std::vector<std::vector<char>> out = {host[1], host[2], host[2]};
  for (int r = 0; r < 2; ++r) backend.copy_to_host(out[r].data(), device[r + 1], bytes);
  for (void* p : device) backend.deallocate(p);
  backend.deallocate(scalars);
  return out;
}

// On the fenced device (memory that faults on any host access) the update equals the CPU's bit for bit in float32
// and bfloat16 storage and reads nothing back (what a GPU step needs: the keep flags and the clipping factor stay on
// the device); the matrix kept out is unchanged, bit for bit, and the others moved.
TEST(CapiCalls, MuonUpdateOnTheFencedDeviceEqualsTheCpuBitForBitAndReadsNothingBack) {
  test::FencedBackend fenced;
  const int64_t k = 3, rows = 24, cols = 40, n = rows * cols;
  for (DType storage : {DType::f32, DType::bf16}) {
    const auto cpu = muon_update_on(cpu_backend(), storage, k, rows, cols, 2);
    int64_t read_back = -1;
    const auto device = muon_update_on(fenced, storage, k, rows, cols, 2, [&] { return fenced.copies_to_host(); },
                                       &read_back);
    EXPECT_EQ(device[0], cpu[0]) << to_string(storage) << " momenta";
    EXPECT_EQ(device[1], cpu[1]) << to_string(storage) << " weights";
    EXPECT_EQ(read_back, 0) << to_string(storage);
    const size_t size = dtype_size(storage), matrix = static_cast<size_t>(n) * size;
    for (int64_t j = 0; j < k; ++j) {
      const bool same = std::equal(cpu[1].begin() + j * matrix, cpu[1].begin() + (j + 1) * matrix,
                                   cpu[2].begin() + j * matrix);
      EXPECT_EQ(same, j == 2) << to_string(storage) << " weights of matrix " << j;
    }
  }
}

// The Muon calls' staging holds float32 slots for widened operands only when some operand is bfloat16 (M6: all-float32
// calls used to keep three of the largest tensor per thread, for nothing): momentum 3, apply 2 and the whole update 3
// slots of the largest tensor with bfloat16 operands, none with float32 ones; the update's U stack and unchecked
// norms either way.
TEST(CapiCalls, Float32OperandsTakeNoStagingSlots) {
  test::FencedBackend fenced;
  const int64_t k = 2, rows = 8, cols = 12, n = rows * cols;
  for (DType storage : {DType::f32, DType::bf16}) {
    Buffer g(fenced, storage, k * n), m(fenced, storage, k * n), w(fenced, storage, k * n), u(fenced, storage, k * n);
    std::vector<capi::Operand> gs, ms, ws, us;
    for (auto [buffer, list] : {std::pair{&g, &gs}, {&m, &ms}, {&w, &ws}, {&u, &us}}) {
      const std::vector<char> values = random_stack(storage, k, rows, cols, 21);
      fenced.copy_from_host(buffer->data(), values.data(), values.size());
      for (int64_t j = 0; j < k; ++j)
        list->push_back({static_cast<char*>(buffer->data()) + j * n * dtype_size(storage), storage});
    }
    const std::vector<int64_t> sizes(k, n);
    const std::vector<double> scales(k, 1.0);
    capi::Staging momentum, apply, update;
    capi::muon_momentum_run(fenced, sizes, gs, ms, us, {}, 0.95, true, momentum);
    capi::muon_apply_run(fenced, sizes, ws, us, {}, 0.02, 0.1, scales, false, apply);
    capi::muon_update_run(fenced, rows, cols, gs, ms, ws, {}, 0.95, true, 0.02, 0.1, 1.0, false,
                          capi::call_ns_options(fenced, {}, NsOptions{}, std::nullopt, storage, rows, cols, k),
                          {}, update, false);
    const bool narrow = storage == DType::bf16;
    EXPECT_EQ(momentum.elements(fenced), narrow ? 3 * n : 0) << to_string(storage);
    EXPECT_EQ(apply.elements(fenced), narrow ? 2 * n : 0) << to_string(storage);
    EXPECT_EQ(update.elements(fenced), (k + (narrow ? 3 : 0)) * n + 2 * k) << to_string(storage);  // + k doubles
  }
}

// A staging's end (dmuon_ns_destroy, a thread's exit) frees its buffers only while it holds their backend (M7): a
// deallocation on a CUDA backend drops graphs from the cache a call on another thread may be using.
TEST(CapiCalls, AStagingEndsUnderItsBackendsHold) {
  test::FencedBackend fenced;
  auto staging = std::make_unique<capi::Staging>();
  staging->take(fenced, 16);
  staging->norms(fenced, 2);
  std::atomic<bool> ended = false;
  std::thread ender;
  {
    const auto held = capi::hold(fenced);  // a call on another thread, in progress
    ender = std::thread([&] {
      staging.reset();
      ended = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a window for an end that does not wait to show
    EXPECT_FALSE(ended.load()) << "the staging freed its buffers while a call held their backend";
  }
  ender.join();
  EXPECT_TRUE(ended.load());
}

// bf16 AdamW is the float32 step on the widened values with p, m, v rounded once.
TEST(CapiCalls, Bfloat16AdamWIsTheFloat32StepRoundedOnce) {
  const int64_t n = 5000;
  const auto bf16 = adamw_on(cpu_backend(), DType::bf16, n, 1);
  const auto start = std::vector<std::vector<char>>{random_stack(DType::bf16, 1, 1, n, 1),
                                                    random_stack(DType::bf16, 1, 1, n, 2, 1e-2f)};
  std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) p[i] = value_at(start[0], DType::bf16, i), g[i] = value_at(start[1], DType::bf16, i);
  adamw_step(p, g, 0.5f, m, v, 1, AdamWHyper{1e-2, 0.9, 0.999, 1e-8, 0.1});
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(value_at(bf16[0], DType::bf16, i), round_to_bf16(p[i])) << "p[" << i << "]";
    ASSERT_EQ(value_at(bf16[2], DType::bf16, i), round_to_bf16(m[i])) << "exp_avg[" << i << "]";
    ASSERT_EQ(value_at(bf16[3], DType::bf16, i), round_to_bf16(v[i])) << "exp_avg_sq[" << i << "]";
  }
}

// bf16 storage on the CPU: widened exactly, orthogonalized in float32, rounded once. So the result is the float32
// engine's on the bf16 values, rounded to bf16, bit for bit; and against the float64 recurrence on the same (exactly
// representable) bf16 values it is off by at most the final rounding, 2^-8 relative per element (bf16 keeps 8
// significant bits), plus the float32 engine's own error ε (1e-5 standard; 2e-4 Gram, DESIGN 2.2):
//   ‖bf16(y) − ref‖ ≤ ‖bf16(y) − y‖ + ‖y − ref‖ ≤ 2^-8·‖y‖ + ε‖ref‖ ≤ (2^-8·(1 + ε) + ε)·‖ref‖.
// Truncation instead of rounding (up to 2^-7) or a second rounding through bf16 iterates would exceed it.
TEST(CapiCalls, Bfloat16NewtonSchulzOnTheCpuIsWithinItsBoundOfFloat64) {
  const int64_t k = 3;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{24, 64}, {64, 24}, {48, 48}}) {
    for (NsAlgo algo : {NsAlgo::standard, NsAlgo::gram}) {
      NsOptions options;
      options.algo = algo;
      const double eps = algo == NsAlgo::standard ? 1e-5 : 2e-4;
      const double bound = std::ldexp(1.0, -8) * (1 + eps) + eps;
      const std::vector<char> stack = random_stack(DType::bf16, k, rows, cols, 31 + rows);
      const std::vector<char> got = ns_on(cpu_backend(), stack, DType::bf16, k, rows, cols, options);
      std::vector<float> wide(k * rows * cols);
      for (size_t i = 0; i < wide.size(); ++i) wide[i] = value_at(stack, DType::bf16, static_cast<int64_t>(i));
      std::vector<float> f32(wide.size());
      for (int64_t j = 0; j < k; ++j)
        newton_schulz(wide.data() + j * rows * cols, f32.data() + j * rows * cols, rows, cols, options);
      for (size_t i = 0; i < wide.size(); ++i)
        ASSERT_EQ(value_at(got, DType::bf16, static_cast<int64_t>(i)), round_to_bf16(f32[i])) << "element " << i;
      for (int64_t j = 0; j < k; ++j) {
        const test::MatD u = test::from_floats(wide.data() + j * rows * cols, rows, cols);
        const test::MatD ref = test::standard_ns_reference(u, ns_schedule(options.coeffs, options.steps), 1.0);
        test::MatD o(rows, cols);
        for (int64_t i = 0; i < rows * cols; ++i) o.v[i] = value_at(got, DType::bf16, j * rows * cols + i);
        const double err = test::relative_distance(o, ref);
        EXPECT_LE(err, bound) << rows << "x" << cols << " " << to_string(algo) << " matrix " << j;
        EXPECT_GT(err, 0.05 * bound) << "no rounding at all? " << rows << "x" << cols;
      }
    }
  }
}

// The compute dtype is the caller's when asked for, never inferred from the storage; unasked, the device's default:
// on the CPU cpu_ns_default_dtype (whatever the storage; its rule is backend_conformance_test's), a GPU's (here the
// recording backend, which computes in both) the storage's.
TEST(CapiCalls, ComputeDtypeIsAskedForOrTheDevicesDefault) {
  const Backend& cpu = cpu_backend();
  for (const DType storage : {DType::f32, DType::bf16}) {
    EXPECT_EQ(capi::ns_compute_dtype(cpu, std::nullopt, storage), cpu_ns_default_dtype());
    EXPECT_EQ(capi::ns_compute_dtype(cpu, DType::f32, storage), DType::f32);
    if (cpu.supports(DType::bf16)) {
      EXPECT_EQ(capi::ns_compute_dtype(cpu, DType::bf16, storage), DType::bf16);
    } else {
      EXPECT_THROW(capi::ns_compute_dtype(cpu, DType::bf16, storage), Error);
    }
  }
  RecordingBackend gpu_like;
  EXPECT_EQ(capi::ns_compute_dtype(gpu_like, std::nullopt, DType::f32), DType::f32);
  EXPECT_EQ(capi::ns_compute_dtype(gpu_like, std::nullopt, DType::bf16), DType::bf16);
  EXPECT_EQ(capi::ns_compute_dtype(gpu_like, DType::f32, DType::bf16), DType::f32);
}

// A call's options: bf16 takes DESIGN 2.2's half-precision restarts unless others were asked for; the CPU's tuned
// kernel is the one tuned in the compute dtype asked for (a float32 entry never serves a bf16 call); a call that asks
// for none runs the entry chosen among the CPU's dtypes (auto_tune_dtypes) in its dtype where one has the shape,
// else the device's default. An asked dtype is never replaced by the chosen one.
TEST(CapiCalls, CallOptionsTakeTheComputeDtypesTuning) {
  const NsOptions defaults;
  EXPECT_EQ(capi::call_ns_options(cpu_backend(), {}, defaults, DType::f32, DType::f32, 8, 8, 1), defaults);
  RecordingBackend gpu_like;
  const NsOptions bf16 = capi::call_ns_options(gpu_like, {}, defaults, DType::bf16, DType::f32, 8, 8, 1);
  EXPECT_EQ(bf16.dtype, DType::bf16);
  EXPECT_EQ(bf16.restarts, (std::vector<int>{1, 3}));
  NsOptions chosen;
  chosen.restarts = {2, 4};
  EXPECT_EQ(capi::call_ns_options(gpu_like, {}, chosen, DType::bf16, DType::f32, 8, 8, 1).restarts, chosen.restarts);
  TuneEntry f32_entry{8, 8, 1, defaults, 1.0, 1.0, {}};
  f32_entry.options.algo = NsAlgo::gram;
  f32_entry.options.tiles = 3;
  capi::TunedEntries tuned;
  tuned.by_dtype = {{DType::f32, {f32_entry}}};
  EXPECT_EQ(capi::call_ns_options(cpu_backend(), tuned, defaults, DType::f32, DType::f32, 8, 8, 1).tiles, 3);
  const bool onednn = cpu_backend().supports(DType::bf16);
  if (onednn) {
    const NsOptions untuned = capi::call_ns_options(cpu_backend(), tuned, defaults, DType::bf16, DType::f32, 8, 8, 1);
    EXPECT_EQ(untuned.tiles, defaults.tiles);
    EXPECT_EQ(untuned.algo, defaults.algo);
    EXPECT_EQ(untuned.dtype, DType::bf16);
  } else {  // no oneDNN: an asked bf16 is refused, naming the device
    EXPECT_THROW(capi::call_ns_options(cpu_backend(), tuned, defaults, DType::bf16, DType::f32, 8, 8, 1), Error);
  }
  // Chosen by measurement: each dtype in turn wins the 8x8 shape (the handle's entries of dmuon_tune's setting).
  for (const DType faster : {DType::f32, DType::bf16}) {
    if (!cpu_backend().supports(faster)) continue;  // no oneDNN: float32 only
    TuneEntry won{8, 8, 1, untuned_options(1, faster), 1.0, 2.0, {{DType::f32, 1.0}, {DType::bf16, 1.0}}};
    won.options.tiles = 5;
    won.dtype_seconds[faster == DType::f32 ? DType::bf16 : DType::f32] = 1.5;
    tuned.chosen = {won};
    const NsOptions unasked = capi::call_ns_options(cpu_backend(), tuned, defaults, std::nullopt, DType::f32, 8, 8, 1);
    EXPECT_EQ(unasked.dtype, faster);
    EXPECT_EQ(unasked.tiles, 5);
    EXPECT_EQ(unasked.restarts, won.options.restarts);
    for (const DType asked : {DType::f32, DType::bf16}) {  // asked: its own dtype's entries (f32's) or the defaults
      if (!cpu_backend().supports(asked)) continue;
      const NsOptions o = capi::call_ns_options(cpu_backend(), tuned, defaults, asked, DType::f32, 8, 8, 1);
      EXPECT_EQ(o.dtype, asked);
      EXPECT_EQ(o.tiles, asked == DType::f32 ? 3 : defaults.tiles);
    }
    // Another shape, or a GPU: the device's default, untuned.
    EXPECT_EQ(capi::call_ns_options(cpu_backend(), tuned, defaults, std::nullopt, DType::f32, 8, 16, 1).dtype,
              cpu_ns_default_dtype());
    EXPECT_EQ(capi::call_ns_options(gpu_like, tuned, defaults, std::nullopt, DType::f32, 8, 8, 1).tiles, defaults.tiles);
  }
}

}  // namespace
}  // namespace dmuon
