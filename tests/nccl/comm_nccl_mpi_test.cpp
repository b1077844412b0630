// The NCCL communicator on device buffers, against results known by formula (as nccl-tests): every collective,
// uneven counts with empty blocks, average and max. Runs under mpirun at every world size; skips (on every rank
// alike) without a NCCL build, without a CUDA device, or with more ranks on a node than GPUs, since NCCL refuses
// two ranks on one GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/comm.hpp"
#ifdef DMUON_HAVE_NCCL
#include "dmuon/comm_nccl.hpp"
#endif

namespace dmuon::comm {
namespace {

// A device copy of host values of type T.
template <typename T>
struct DeviceArray {
  Backend& backend;
  T* data;
  size_t n;
  DeviceArray(Backend& b, const std::vector<T>& host)
      : backend(b), data(static_cast<T*>(b.allocate(sizeof(T) * std::max<size_t>(host.size(), 1)))), n(host.size()) {
    b.copy_from_host(data, host.data(), sizeof(T) * n);
  }
  ~DeviceArray() { backend.deallocate(data); }
  std::vector<T> read() const {
    std::vector<T> out(n);
    backend.copy_to_host(out.data(), data, sizeof(T) * n);
    return out;
  }
  std::span<T> span() const { return {data, n}; }
};

template <typename T>
T value(int rank, int64_t i) {
  return static_cast<T>(1000 * rank + i);
}

// Odd, uneven per-rank counts with zeros: rank r has (3r + 1) mod 4 elements.
std::vector<int64_t> uneven_counts(int n) {
  std::vector<int64_t> c(n);
  for (int r = 0; r < n; ++r) c[r] = (3 * r + 1) % 4;
  return c;
}

class NcclComm : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef DMUON_HAVE_NCCL
    GTEST_SKIP() << "this build has no NCCL communicator (DMUON_CUDA=OFF or NCCL not found)";
#else
    mpi = world();
    // Every rank must take the same decision, or the ones that go on wait for the ones that skipped.
    int64_t usable = mpi->node().size() <= device_count(DeviceKind::cuda) ? 1 : 0;
    mpi->all_reduce<int64_t>(std::span<int64_t>(&usable, 1), ReduceOp::min).wait();
    if (usable == 0)
      GTEST_SKIP() << "needs one CUDA device per rank of a node (" << mpi->node().size() << " ranks, "
                   << device_count(DeviceKind::cuda) << " devices here); NCCL refuses two ranks on one GPU";
    backend = &backend_for(DeviceKind::cuda, local_device_index(*mpi));
    nccl = nccl_world(mpi, *backend);
#endif
  }
  std::shared_ptr<Comm> mpi, nccl;
  Backend* backend = nullptr;
};

TEST_F(NcclComm, AllReduceSumAndAverage) {
  const int n = nccl->size(), me = nccl->rank();
  std::vector<float> x(1001);
  for (int64_t i = 0; i < 1001; ++i) x[i] = value<float>(me, i);
  DeviceArray<float> d(*backend, x);
  nccl->all_reduce(std::span<float>(d.span()), ReduceOp::sum).wait();
  const auto sum = d.read();
  for (int64_t i = 0; i < 1001; ++i) ASSERT_EQ(sum[i], 1000.0f * n * (n - 1) / 2 + n * i) << i;

  std::vector<double> y(77);
  for (int64_t i = 0; i < 77; ++i) y[i] = value<double>(me, i);
  DeviceArray<double> dy(*backend, y);
  nccl->all_reduce(std::span<double>(dy.span()), ReduceOp::average).wait();
  const auto avg = dy.read();
  for (int64_t i = 0; i < 77; ++i) ASSERT_NEAR(avg[i], 1000.0 * (n - 1) / 2 + i, 1e-12 * (1000.0 * n + i)) << i;  // ncclAvg may scale before summing
}

TEST_F(NcclComm, AllGathervUnevenWithEmptyBlocks) {
  const int n = nccl->size(), me = nccl->rank();
  const auto counts = uneven_counts(n);
  std::vector<int64_t> mine(counts[me]);
  for (int64_t i = 0; i < counts[me]; ++i) mine[i] = value<int64_t>(me, i);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  DeviceArray<int64_t> send(*backend, mine), recv(*backend, std::vector<int64_t>(total, -1));
  nccl->all_gatherv<int64_t>(std::span<const int64_t>(send.data, send.n), recv.span(), counts).wait();
  const auto got = recv.read();
  int64_t at = 0;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < counts[r]; ++i, ++at) ASSERT_EQ(got[at], value<int64_t>(r, i)) << "rank " << r;
}

TEST_F(NcclComm, ReduceScattervUnevenAndEven) {
  const int n = nccl->size(), me = nccl->rank();
  for (const auto& counts : {uneven_counts(n), std::vector<int64_t>(n, 5)}) {
    int64_t total = 0, offset = 0;
    for (int r = 0; r < n; ++r) {
      if (r < me) offset += counts[r];
      total += counts[r];
    }
    std::vector<float> x(total);
    for (int64_t i = 0; i < total; ++i) x[i] = value<float>(me, i);
    DeviceArray<float> send(*backend, x), recv(*backend, std::vector<float>(counts[me], -1));
    nccl->reduce_scatterv<float>(std::span<const float>(send.data, send.n), recv.span(), counts, ReduceOp::sum).wait();
    const auto got = recv.read();
    for (int64_t i = 0; i < counts[me]; ++i) ASSERT_EQ(got[i], 1000.0f * n * (n - 1) / 2 + n * (offset + i)) << i;
  }
}

TEST_F(NcclComm, Broadcast) {
  const int n = nccl->size(), me = nccl->rank(), root = n - 1;
  std::vector<double> x(33);
  for (int64_t i = 0; i < 33; ++i) x[i] = value<double>(me, i);
  DeviceArray<double> b(*backend, x);
  nccl->broadcast(b.span(), root).wait();
  const auto got = b.read();
  for (int64_t i = 0; i < 33; ++i) ASSERT_EQ(got[i], value<double>(root, i));
}

// Host buffers (the library's control messages) go over the MPI communicator NCCL was made from; mixing host
// and device buffers is refused; rank_device agrees with the node index once every rank has its own GPU.
TEST_F(NcclComm, HostBuffersGoOverMpiAndEveryRankHasItsOwnGpu) {
  const int n = nccl->size(), me = nccl->rank();
  EXPECT_TRUE(nccl->device_buffers());
  std::vector<double> x = {me + 1.0, 2.0 * me};
  nccl->all_reduce(std::span<double>(x), ReduceOp::sum).wait();
  EXPECT_EQ(x[0], n * (n + 1) / 2.0);
  EXPECT_EQ(x[1], 1.0 * n * (n - 1));
  DeviceArray<double> d(*backend, {1.0, 2.0});
  EXPECT_THROW(nccl->all_reduce_raw(x.data(), d.data, 2, DType::f64, ReduceOp::sum), Error);
#ifdef DMUON_HAVE_NCCL
  EXPECT_EQ(rank_device(*mpi), local_device_index(*mpi));
#endif
}

}  // namespace
}  // namespace dmuon::comm
