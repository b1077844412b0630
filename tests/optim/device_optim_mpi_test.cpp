// The distributed optimizers with their memory on a device, at every world size the suite runs (1..4): every
// kind of the kinds table (support/optimizer_kinds.hpp) in each of its shard modes (DMuon, MuonGatherCompute and
// ShardedAdamW in z3, z2 and replicated; Muon on one rank), built by make_optimizer_stack with a device backend
// and a communicator that takes device memory.
//  - On the fenced test device (support/fenced_device.hpp), every CI run: parameters, gradients, the unit
//    buffers and every optimizer state buffer are PROT_NONE except inside a backend operation or a
//    collective, so any host access to them on these paths is a SIGSEGV. The results — every weight, every
//    state buffer, the gradient norm of every step, the skipped step — must equal the same run on the CPU
//    backend over MPI bit for bit: the same kernels run in the same order. Newton–Schulz goes through
//    Backend::run_graph, which the fenced device replays as a GPU would, so a graph key that missed an address
//    would replay onto stale buffers and break the equality. Checkpoints saved from the device load into the
//    CPU and back into the device bit for bit.
//  - On GPUs, one per rank over NCCL (skips on every rank alike without a NCCL build, without a CUDA device, or
//    with more ranks on a node than GPUs): the same cases against the CPU run within float32 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>

#include "dmuon/checkpoint.hpp"
#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/optimizer_factory.hpp"
#include "dmuon/plan.hpp"  // default_owners
#include "fenced_device.hpp"
#include "hook_pass.hpp"
#include "optimizer_kinds.hpp"
#include "test_world.hpp"
#include "test_data.hpp"
#include "toy_model.hpp"
#ifdef DMUON_HAVE_NCCL
#include "dmuon/comm_nccl.hpp"
#endif

namespace dmuon {
namespace {

using shard::Mode;

// Mixed shapes: wide, tall, two 8×8 (one NS batch), a tiny matrix, elementwise parameters that the
// owner-aligned layout splits over shards (multi-segment copies), a matrix moved to AdamW by a rule.
std::vector<ParamSpec> specs() {
  return {{"embed", {11, 6}, ParamRole::elementwise, 0}, {"l.wide", {6, 14}, ParamRole::matrix, 1},
          {"l.tall", {14, 6}, ParamRole::matrix, 1},     {"l.q", {8, 8}, ParamRole::matrix, 1},
          {"l.k", {8, 8}, ParamRole::matrix, 1},         {"l.tiny", {2, 3}, ParamRole::matrix, 1},
          {"l.norm", {7}, ParamRole::elementwise, 1},    {"head", {5, 8}, ParamRole::matrix, 2},
          {"out.wide", {6, 14}, ParamRole::matrix, 2}};
}

constexpr int kSteps = 6;
constexpr int kPoisonStep = 2;  // the last rank's gradient of parameter 0 holds a NaN: every rank skips

// Rank r's gradient of parameter p at step t: seeded N(0,1), scaled down every third step (clipping off).
std::vector<float> rank_gradient(int p, int t, int r, int64_t n, int ranks) {
  std::mt19937 rng(10007 * t + 101 * p + r);
  std::normal_distribution<float> d;
  std::vector<float> g(n);
  for (float& x : g) x = (t % 3 == 1 ? 0.1f : 1.0f) * d(rng);
  if (t == kPoisonStep && p == 0 && r == ranks - 1) g[0] = std::numeric_limits<float>::quiet_NaN();
  return g;
}

// A case: a kind of the table in one of its modes, with a Newton–Schulz variant. The variants take turns
// over the cases, so that each Muon kind runs both recurrences and both batch modes.
struct Case {
  std::string name;
  OptimKind kind;
  Mode mode;
  NsAlgo algo;
  NsBatchMode batch_mode;
};
Case make_case(const test::KindMode& km) {
  struct Variant {
    NsAlgo algo;
    NsBatchMode batch_mode;
    const char* name;
  };
  static constexpr Variant kVariants[] = {{NsAlgo::gram, NsBatchMode::sequential, "gram"},
                                          {NsAlgo::standard, NsBatchMode::concurrent, "standard concurrent"},
                                          {NsAlgo::gram, NsBatchMode::concurrent, "gram concurrent"},
                                          {NsAlgo::standard, NsBatchMode::sequential, "standard"}};
  const Variant& v = kVariants[(static_cast<int>(km.row.kind) + static_cast<int>(km.mode)) % std::size(kVariants)];
  return {std::string(to_string(km.row.kind)) + " " + std::string(shard::to_string(km.mode)) + " " + v.name,
          km.row.kind, km.mode, v.algo, v.batch_mode};
}

OptimizerStackOptions stack_options(const Case& c, int ranks, Backend* backend) {
  OptimizerStackOptions o;
  o.kind = c.kind;
  o.mode = c.mode;
  o.optimizer.muon.weight_decay = 0.01;
  o.optimizer.muon.ns.algo = c.algo;
  o.optimizer.muon.ns.batch_mode = c.batch_mode;
  o.optimizer.muon.ns.threads = c.batch_mode == NsBatchMode::concurrent ? 2 : 1;
  o.optimizer.adamw.weight_decay = 0.1;
  o.optimizer.rules = {{"head", OptimGroup::adamw}};
  o.optimizer.clip_grad_norm = 4.0;
  o.optimizer.nonfinite = NonFinitePolicy::skip;
  if (optim_kind_info(c.kind).takes_owners) o.owners = default_owners(specs(), ranks);
  o.backend = backend;
  return o;
}

// What a run leaves: every parameter's full value, this rank's state buffers, the norms, the skips.
struct Result {
  std::vector<std::vector<float>> values;
  std::map<std::pair<std::string, std::string>, std::vector<float>> state;
  std::vector<double> grad_norms;
  int64_t skipped = 0;
};

// Case c's stack on `backend` (the CPU or the fenced device) over `comm`, loaded with the toy model's values.
// Every host access to the backend's memory here and below goes through backend copies.
OptimizerStack make_stack(const Case& c, Backend& backend, std::shared_ptr<comm::Comm> comm) {
  OptimizerStack stack = make_optimizer_stack(comm, specs(), stack_options(c, comm->size(), &backend));
  const test::ToyModel init(specs(), 7);
  for (int p = 0; p < stack.params->registry().size(); ++p) stack.params->load_full(p, init.values[p]);
  return stack;
}

// kSteps steps of this rank's gradients; the gradient norm of each.
std::vector<double> train(OptimizerStack& stack, int rank, int ranks) {
  shard::ShardedParams& sp = *stack.params;
  std::vector<double> norms;
  for (int t = 0; t < kSteps; ++t) {
    test::hook_pass(sp, [&](int p, DeviceSpan<float> g) {
      const std::vector<float> v = rank_gradient(p, t, rank, static_cast<int64_t>(g.size()), ranks);
      sp.backend().copy_from_host(g.data(), v.data(), sizeof(float) * v.size());
    });
    stack.optimizer->step();
    norms.push_back(stack.optimizer->last_grad_norm());
  }
  return norms;
}

// Every parameter's full value (gathered), this rank's state buffers and the skipped steps.
Result read(OptimizerStack& stack) {
  shard::ShardedParams& sp = *stack.params;
  Backend& backend = sp.backend();
  Result out;
  out.skipped = stack.optimizer->skipped_steps();
  out.values.resize(specs().size());
  for (int u = 0; u < sp.num_units(); ++u) {
    sp.gather(u);
    sp.wait(u);
    for (int p : sp.layout(u).params) {
      out.values[p].resize(sp.param(p).size());
      backend.copy_to_host(out.values[p].data(), sp.param(p).data(), sizeof(float) * out.values[p].size());
    }
    sp.release(u);
  }
  for (const StateSlice& s : stack.optimizer->state_slices()) {
    std::vector<float>& v = out.state[{s.param, s.kind}];
    v.resize(s.count);
    backend.copy_to_host(v.data(), s.data, sizeof(float) * v.size());
  }
  return out;
}

Result run(const Case& c, Backend& backend, std::shared_ptr<comm::Comm> comm) {
  OptimizerStack stack = make_stack(c, backend, comm);
  const std::vector<double> norms = train(stack, comm->rank(), comm->size());
  Result out = read(stack);
  out.grad_norms = norms;
  return out;
}

// Bit-for-bit equality of two float arrays (NaN patterns included).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // memcmp of zero bytes still needs valid pointers, and an empty vector's data() may be null.
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0);
}

test::FencedBackend& fenced() {
  static test::FencedBackend device;
  return device;
}

// Weights, state buffers and skipped steps equal bit for bit.
void expect_same(const Result& got, const Result& want) {
  EXPECT_EQ(got.skipped, want.skipped);
  ASSERT_EQ(got.values.size(), want.values.size());
  for (size_t p = 0; p < want.values.size(); ++p) {
    EXPECT_TRUE(same_bits(got.values[p], want.values[p])) << "parameter " << specs()[p].name;
  }
  ASSERT_EQ(got.state.size(), want.state.size());
  for (const auto& [key, values] : want.state) {
    ASSERT_TRUE(got.state.count(key)) << key.first << " " << key.second;
    EXPECT_TRUE(same_bits(got.state.at(key), values)) << key.first << " " << key.second;
  }
}

// Each kind of the table in each of its modes, on the fenced device; a kind that runs on fewer ranks skips.
class FencedDevice : public ::testing::TestWithParam<test::KindMode> {
 protected:
  void SetUp() override {
    if (!GetParam().row.runs_at(test::world()->size()))
      GTEST_SKIP() << to_string(GetParam().row.kind) << " runs on at most " << GetParam().row.max_ranks << " ranks";
  }
  const Case c = make_case(GetParam());
};

TEST_P(FencedDevice, OptimizersNeverTouchDeviceMemoryAndMatchTheCpuBitForBit) {
  const auto world = test::world();
  const auto fenced_world = test::fenced_comm(world, fenced().fence());
  SCOPED_TRACE(c.name + " on rank " + std::to_string(world->rank()) + " of " + std::to_string(world->size()));
  const int64_t replayed = fenced().graphs_replayed();
  const Result cpu = run(c, cpu_backend(), world);
  const Result device = run(c, fenced(), fenced_world);
  EXPECT_EQ(device.skipped, 1);
  EXPECT_EQ(cpu.grad_norms, device.grad_norms);
  expect_same(device, cpu);
  // Gather-then-compute runs NS on every matrix on every rank, so every rank replays recorded graphs.
  if (c.kind == OptimKind::muon_gather) {
    EXPECT_GT(fenced().graphs_replayed(), replayed);
  }
}

// Checkpoints move optimizer state through the backend: saved from the fenced device, loaded into the CPU and
// into the fenced device again, both hold what was saved, bit for bit.
TEST_P(FencedDevice, CheckpointsSaveAndLoadDeviceState) {
  const auto world = test::world();
  const auto fenced_world = test::fenced_comm(world, fenced().fence());
  test::TempDir tmp;
  const std::string dir = test::shared_folder(tmp);
  SCOPED_TRACE(c.name + " on rank " + std::to_string(world->rank()));
  OptimizerStack device = make_stack(c, fenced(), fenced_world);
  train(device, world->rank(), world->size());
  save_checkpoint(dir, *device.optimizer);
  const Result saved = read(device);
  OptimizerStack cpu = make_stack(c, cpu_backend(), world);
  load_checkpoint(dir, *cpu.optimizer);
  expect_same(read(cpu), saved);
  OptimizerStack again = make_stack(c, fenced(), fenced_world);
  load_checkpoint(dir, *again.optimizer);
  expect_same(read(again), saved);
}

TEST_P(FencedDevice, DeviceMemoryWithAHostOnlyCommunicatorIsRefused) {
  try {
    make_optimizer_stack(test::world(), specs(), stack_options(c, test::world()->size(), &fenced()));
    FAIL() << "a fenced backend over MPI was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("host memory only"), std::string::npos) << e.what();
  }
}

// Two batches of the same shape in different buffers, orthogonalized with device norms (the optimizer's
// call): each result equals the CPU's, so a recorded graph never replays onto the other batch's buffers.
TEST(FencedDeviceGraphs, GraphKeysTellBuffersApart) {
  const int64_t rows = 6, cols = 10;
  NsOptions ns;
  ns.algo = NsAlgo::gram;
  std::vector<Buffer> inputs;  // all kept, so that every batch has its own addresses
  Buffer norms(fenced(), DType::f32, 4);  // one for all: only the matrices' addresses tell the calls apart
  for (uint32_t seed : {1u, 2u, 1u}) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    std::vector<float> u(2 * rows * cols);
    for (float& x : u) x = d(rng);
    std::vector<float> expected(u.size());
    {
      Buffer in(cpu_backend(), DType::f32, u.size()), norms(cpu_backend(), DType::f32, 4);
      in.upload(u);
      const MatView views[2] = {in.view(rows, cols, 1, 0), in.view(rows, cols, 1, rows * cols)};
      newton_schulz_batched(cpu_backend(), views, views, ns, {}, reinterpret_cast<double*>(norms.data()));
      in.download(expected);
    }
    Buffer& in = inputs.emplace_back(fenced(), DType::f32, u.size());
    in.upload(u);
    const MatView views[2] = {in.view(rows, cols, 1, 0), in.view(rows, cols, 1, rows * cols)};
    newton_schulz_batched(fenced(), views, views, ns, {}, reinterpret_cast<double*>(norms.data()));
    std::vector<float> got(u.size());
    in.download(got);
    EXPECT_TRUE(same_bits(expected, got)) << "seed " << seed;
  }
}

#ifdef DMUON_HAVE_NCCL
// ‖(x − x0) − (ref − x0)‖ ≤ 1e-4·‖ref − x0‖ per parameter: cuBLAS and OpenBLAS sum products in other
// orders (float32, a few ulps per product), and Newton–Schulz may amplify such a change by up to a^5 ≈ 490
// along small singular values (as tests/optim/cuda_optim_test.cpp's Muon step); NCCL and MPI reduce gradients in
// other orders too.
void expect_close_change(const Result& gpu, const Result& cpu, const test::ToyModel& init) {
  for (size_t p = 0; p < cpu.values.size(); ++p) {
    double d = 0, n = 0;
    for (size_t i = 0; i < cpu.values[p].size(); ++i) {
      d += std::pow(double(gpu.values[p][i]) - cpu.values[p][i], 2);
      n += std::pow(double(cpu.values[p][i]) - init.values[p][i], 2);
    }
    EXPECT_LE(std::sqrt(d), 1e-4 * std::sqrt(n)) << "parameter " << specs()[p].name;
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Kinds, FencedDevice, ::testing::ValuesIn(test::kinds_and_modes(test::TestDevice::fenced)),
                         test::kind_mode_name);

// The same cases on GPUs (the kinds tested on the fenced device).
class CudaNccl : public FencedDevice {};

TEST_P(CudaNccl, OptimizersOnEachRanksGpuMatchTheCpuWithinFloat32Rounding) {
#ifndef DMUON_HAVE_NCCL
  GTEST_SKIP() << "this build has no NCCL communicator (DMUON_CUDA=OFF or NCCL not found)";
#else
  const auto world = test::world();
  // Every rank must take the same decision, or the ones that go on wait for the ones that skipped.
  int64_t usable = world->node().size() <= device_count(DeviceKind::cuda) ? 1 : 0;
  world->all_reduce<int64_t>(std::span<int64_t>(&usable, 1), ReduceOp::min).wait();
  if (usable == 0) GTEST_SKIP() << "needs one CUDA device per rank of a node; NCCL refuses two ranks on one GPU";
  Backend& gpu = backend_for(DeviceKind::cuda, comm::rank_device(*world));
  const test::ToyModel init(specs(), 7);
  SCOPED_TRACE(c.name + " on rank " + std::to_string(world->rank()));
  const Result cpu = run(c, cpu_backend(), world);
  const Result device = run(c, gpu, comm::nccl_world(world, gpu));
  EXPECT_EQ(cpu.skipped, device.skipped);
  for (size_t t = 0; t < cpu.grad_norms.size(); ++t)
    EXPECT_NEAR(device.grad_norms[t], cpu.grad_norms[t], 1e-6 * cpu.grad_norms[t]) << "step " << t;
  expect_close_change(device, cpu, init);
#endif
}

INSTANTIATE_TEST_SUITE_P(Kinds, CudaNccl, ::testing::ValuesIn(test::kinds_and_modes(test::TestDevice::fenced)),
                         test::kind_mode_name);

}  // namespace
}  // namespace dmuon
