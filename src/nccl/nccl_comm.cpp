// The NCCL backend of dmuon::comm::Comm (comm_nccl.hpp): collectives on device buffers, queued on the
// communicator's stream after the CUDA backend's queue, completing on CUDA events. The only file that includes
// <nccl.h>.
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda_support.hpp"  // DMUON_CUDA_CHECK, cuda::query_event
#include "comm/collective_checks.hpp"
#include "comm/failure.hpp"
#include "comm/polling.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/comm_nccl.hpp"
#include "dmuon/rank_agreement.hpp"
#include "nccl/comm_kernels.hpp"

namespace dmuon::comm {

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
    case DType::bf16:
      return ncclBfloat16;
  }
  DMUON_FAIL("unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::average:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  DMUON_FAIL("unknown reduce op");
}

void check_nccl(ncclResult_t rc, const std::string& what, int rank, ncclComm_t comm = nullptr) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  detail::mark_comm_failed();
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  DMUON_FAIL("NCCL ", what, " failed on rank ", rank, ": ", ncclGetErrorString(rc),
             last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string());
}

// One queued NCCL operation: done when the event recorded after it has fired.
class NcclWork : public WorkState {
 public:
  NcclWork(std::string what, int rank, int size, double timeout_s, ncclComm_t comm, cudaStream_t stream)
      : what_(std::move(what)), rank_(rank), size_(size), timeout_s_(timeout_s), comm_(comm) {
    DMUON_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    DMUON_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  // Dropped unfinished: the peers need this rank's part and the buffers are in use until the event fires, so
  // wait for it (bounded by the timeout, never throwing); past it the communicator is marked failed.
  ~NcclWork() override {
    if (!done_ && !detail::comm_failed()) {
      double waited_s = 0;
      const bool finished = detail::poll_until([&] { return query_event() != cudaErrorNotReady; }, timeout_s_,
                                               waited_s);
      if (!finished) detail::mark_comm_failed();
    }
    cudaEventDestroy(event_);
  }
  bool test() override {
    if (done_) return true;
    ncclResult_t state = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &state), what_ + " (ncclCommGetAsyncError)", rank_, comm_);
    check_nccl(state, what_, rank_, comm_);
    const cudaError_t rc = query_event();
    if (rc == cudaErrorNotReady) return false;
    if (rc != cudaSuccess) {
      detail::mark_comm_failed();
      DMUON_FAIL("NCCL ", what_, " on rank ", rank_, ": CUDA error ", cudaGetErrorString(rc));
    }
    done_ = true;
    return true;
  }
  std::string describe() const override {
    return what_ + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_) + " (NCCL)";
  }

 private:
  // Leaves no cudaErrorNotReady behind for the next launch check (cuda::query_event).
  cudaError_t query_event() const { return cuda::query_event(event_); }

  std::string what_;
  int rank_, size_;
  double timeout_s_;
  ncclComm_t comm_;
  cudaEvent_t event_ = nullptr;
  bool done_ = false;
};

class NcclComm : public Comm {
 public:
  // A communicator over `comm` (from ncclCommInitRank or ncclCommSplit) on CUDA device `device`, queued after
  // `backend_queue` (the CUDA backend's stream), whose host-memory collectives go to `host`, the MPI
  // communicator of the same ranks in the same order.
  NcclComm(ncclComm_t comm, int device, cudaStream_t backend_queue, const Options& options, Topology topology,
           Comm& host)
      : comm_(comm),
        device_(device),
        backend_queue_(backend_queue),
        options_(options),
        topology_(std::move(topology)),
        host_(host) {
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", -1, comm_);
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount", rank_, comm_);
    DMUON_CUDA_CHECK(cudaSetDevice(device_));
    DMUON_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    DMUON_CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
  }
  ~NcclComm() override {
    node_.reset();
    cross_.reset();
    if (detail::comm_failed())
      ncclCommAbort(comm_);
    else
      ncclCommDestroy(comm_);
    cudaEventDestroy(inputs_ready_);
    cudaStreamDestroy(stream_);
  }

  // Node and cross-node children, grouped as the MPI world's (collective over this communicator).
  void build_groups(std::shared_ptr<Comm> mpi_world) {
    mpi_world_ = mpi_world;
    ncclComm_t node = nullptr, cross = nullptr;
    const int node_index = mpi_world->cross().rank(), local_index = mpi_world->node().rank();
    check_nccl(ncclCommSplit(comm_, node_index, rank_, &node, nullptr), "ncclCommSplit (node)", rank_, comm_);
    check_nccl(ncclCommSplit(comm_, local_index, rank_, &cross, nullptr), "ncclCommSplit (cross-node)", rank_, comm_);
    node_ = std::make_unique<NcclComm>(node, device_, backend_queue_, options_, Topology{1, 1, true, {rank_}},
                                       mpi_world->node());
    cross_ = std::make_unique<NcclComm>(cross, device_, backend_queue_, options_, Topology{1, 1, true, {rank_}},
                                        mpi_world->cross());
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const Options& options() const override { return options_; }
  Comm& node() override {
    DMUON_CHECK(node_, "node() is defined on a world communicator only");
    return *node_;
  }
  Comm& cross() override {
    DMUON_CHECK(cross_, "cross() is defined on a world communicator only");
    return *cross_;
  }
  const Topology& topology() const override { return topology_; }
  bool device_buffers() const override { return true; }

  Work all_gather_raw(const void* send, int64_t count, void* recv, DType t) override {
    if (on_host({send, recv}, "all_gather")) return host_.all_gather_raw(send, count, recv, t);
    return post("all_gather", [&] {
      check_nccl(ncclAllGather(send, recv, count, nccl_type(t), comm_, stream_), "all_gather (ncclAllGather)", rank_,
                 comm_);
    });
  }

  Work all_gatherv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t) override {
    if (on_host({send, recv}, "all_gatherv")) return host_.all_gatherv_raw(send, recv, counts, t);
    const std::vector<int64_t> displs = displacements(counts, "all_gatherv");
    if (all_equal(counts)) return all_gather_raw(send, counts[0], recv, t);
    const size_t es = dtype_size(t);
    char* out = static_cast<char*>(recv);
    return post("all_gatherv", [&] {
      char* mine = out + es * displs[rank_];
      if (send != mine && counts[rank_] > 0)
        DMUON_CUDA_CHECK(cudaMemcpyAsync(mine, send, es * counts[rank_], cudaMemcpyDeviceToDevice, stream_));
      group("all_gatherv (grouped ncclSend/ncclRecv)", [&] {
        for (int r = 0; r < size_; ++r) {
          if (r == rank_) continue;
          if (counts[rank_] > 0) p2p(ncclSend(send, counts[rank_], nccl_type(t), r, comm_, stream_), "ncclSend", r);
          if (counts[r] > 0) p2p(ncclRecv(out + es * displs[r], counts[r], nccl_type(t), r, comm_, stream_), "ncclRecv", r);
        }
      });
    });
  }

  Work reduce_scatterv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t,
                           ReduceOp op) override {
    if (on_host({send, recv}, "reduce_scatterv")) return host_.reduce_scatterv_raw(send, recv, counts, t, op);
    check_op(t, op, "reduce_scatterv");
    const std::vector<int64_t> displs = displacements(counts, "reduce_scatterv");
    if (all_equal(counts)) {
      return post("reduce_scatter", [&] {
        check_nccl(ncclReduceScatter(send, recv, counts[0], nccl_type(t), nccl_op(op), comm_, stream_),
                   "reduce_scatter (ncclReduceScatter)", rank_, comm_);
      });
    }
    // Uneven: every rank sends block r of its buffer to rank r, which reduces the size() blocks in rank order.
    const size_t es = dtype_size(t);
    const int64_t mine = counts[rank_];
    const char* in = static_cast<const char*>(send);
    return post("reduce_scatterv", [&] {
      char* blocks = nullptr;
      if (mine > 0)
        DMUON_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&blocks), es * mine * size_, stream_));
      if (mine > 0)
        DMUON_CUDA_CHECK(cudaMemcpyAsync(blocks + es * mine * rank_, in + es * displs[rank_], es * mine,
                                         cudaMemcpyDeviceToDevice, stream_));
      group("reduce_scatterv (grouped ncclSend/ncclRecv)", [&] {
        for (int r = 0; r < size_; ++r) {
          if (r == rank_) continue;
          if (counts[r] > 0) p2p(ncclSend(in + es * displs[r], counts[r], nccl_type(t), r, comm_, stream_), "ncclSend", r);
          if (mine > 0) p2p(ncclRecv(blocks + es * mine * r, mine, nccl_type(t), r, comm_, stream_), "ncclRecv", r);
        }
      });
      if (mine > 0) {
        launch_reduce_blocks(blocks, recv, mine, size_, t, op, stream_);
        DMUON_CUDA_CHECK(cudaFreeAsync(blocks, stream_));
      }
    });
  }

  Work broadcast_raw(void* buf, int64_t count, DType t, int root) override {
    if (on_host({buf}, "broadcast")) return host_.broadcast_raw(buf, count, t, root);
    check_root(root, "broadcast");
    return post("broadcast", [&] {
      check_nccl(ncclBroadcast(buf, buf, count, nccl_type(t), root, comm_, stream_), "broadcast (ncclBroadcast)", rank_,
                 comm_);
    });
  }

  Work all_reduce_raw(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override {
    if (on_host({send, recv}, "all_reduce")) return host_.all_reduce_raw(send, recv, count, t, op);
    check_op(t, op, "all_reduce");
    return post("all_reduce", [&] {
      check_nccl(ncclAllReduce(send, recv, count, nccl_type(t), nccl_op(op), comm_, stream_), "all_reduce (ncclAllReduce)",
                 rank_, comm_);
    });
  }

 private:
  // Whether a collective's buffers (null ones ignored) are host memory, for the MPI communicator, rather than
  // device memory, for NCCL; a mix is refused. Every rank decides alike: a rank's call has a non-null buffer
  // whenever the collective moves any data (zero counts everywhere go to MPI on every rank).
  bool on_host(std::initializer_list<const void*> buffers, const char* what) const {
    int host = 0, device = 0;
    for (const void* p : buffers) {
      if (p == nullptr) continue;
      cudaPointerAttributes a{};
      DMUON_CUDA_CHECK(cudaPointerGetAttributes(&a, p));
      ++(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? device : host);
    }
    DMUON_CHECK(host == 0 || device == 0, what, " on rank ", rank_,
                ": some of its buffers are host memory and some device memory (NCCL takes device memory, host "
                "buffers go over MPI)");
    return device == 0;
  }

  // Queues `enqueue`'s NCCL calls on this stream after the backend's queue, and an event after them.
  template <typename Enqueue>
  Work post(const char* what, Enqueue&& enqueue) {
    DMUON_CHECK(!detail::comm_failed(), what, " on rank ", rank_, ": the communicator failed earlier");
    DMUON_CUDA_CHECK(cudaSetDevice(device_));
    DMUON_CUDA_CHECK(cudaEventRecord(inputs_ready_, backend_queue_));
    DMUON_CUDA_CHECK(cudaStreamWaitEvent(stream_, inputs_ready_, 0));
    enqueue();
    return Work(std::make_shared<NcclWork>(what, rank_, size_, options_.timeout_s, comm_, stream_),
                options_.timeout_s);
  }
  template <typename Calls>
  void group(const char* what, Calls&& calls) {
    check_nccl(ncclGroupStart(), std::string(what) + " (ncclGroupStart)", rank_, comm_);
    calls();
    check_nccl(ncclGroupEnd(), std::string(what) + " (ncclGroupEnd)", rank_, comm_);
  }
  void p2p(ncclResult_t rc, const char* call, int peer) {
    check_nccl(rc, std::string(call) + " with rank " + std::to_string(peer), rank_, comm_);
  }

  static bool all_equal(std::span<const int64_t> counts) {
    for (int64_t c : counts)
      if (c != counts[0]) return false;
    return true;
  }
  std::vector<int64_t> displacements(std::span<const int64_t> counts, const char* what) const {
    detail::check_per_rank_counts(counts, size_, rank_, what);
    std::vector<int64_t> displs;
    int64_t total = 0;
    for (int64_t c : counts) {
      DMUON_CHECK(c >= 0, what, " on rank ", rank_, ": negative count ", c);
      displs.push_back(total);
      total += c;
    }
    return displs;
  }
  void check_root(int root, const char* what) const { detail::check_root(root, size_, rank_, what); }
  void check_op(DType t, ReduceOp op, const char* what) const { detail::check_reduce_op(t, op, rank_, what); }

  ncclComm_t comm_;
  int device_;
  cudaStream_t backend_queue_;
  Options options_;
  Topology topology_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t inputs_ready_ = nullptr;
  Comm& host_;
  std::shared_ptr<Comm> mpi_world_;  // a world communicator's host_, kept alive (null on node and cross)
  std::unique_ptr<NcclComm> node_, cross_;
};

}  // namespace

int local_device_index(Comm& mpi_world) { return mpi_world.node().rank(); }

int rank_device(Comm& mpi_world) {
  const int index = local_device_index(mpi_world);
  Comm& node = mpi_world.node();
  // This rank's GPU (its UUID), or the reason it has none; then every rank of a node sees every UUID of it.
  std::array<uint8_t, 16> uuid{};
  const std::exception_ptr missing = capture_failure(
      [&] {
        const int count = device_count(DeviceKind::cuda);
        DMUON_CHECK(index < count, "rank ", mpi_world.rank(), " is rank ", index, " of ", node.size(),
                    " on its node, which has ", count, " usable CUDA device(s): NCCL needs a GPU of its own for "
                    "every rank (two ranks cannot share one), so start at most ", count, " rank(s) per node");
        cudaDeviceProp prop{};
        DMUON_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
        std::memcpy(uuid.data(), prop.uuid.bytes, uuid.size());
      },
      "choosing this rank's GPU");
  throw_if_any_failed(mpi_world, missing, "a rank has no GPU of its own (its error says why)");
  std::vector<uint8_t> all(uuid.size() * node.size());
  node.all_gather<uint8_t>(uuid, all).wait();
  const std::exception_ptr shared = capture_failure(
      [&] {
        for (int other = 0; other < node.size(); ++other) {
          DMUON_CHECK(other == index || !std::equal(uuid.begin(), uuid.end(), all.begin() + uuid.size() * other),
                      "rank ", mpi_world.rank(), " (cuda:", index, ") and the node's rank ", other,
                      " would share one GPU (the same device UUID; CUDA_VISIBLE_DEVICES may show each rank the "
                      "same one): NCCL refuses two ranks on one GPU");
        }
      },
      "checking that no two ranks share a GPU");
  throw_if_any_failed(mpi_world, shared, "two ranks would share a GPU (their errors say which)");
  return index;
}

std::shared_ptr<Comm> nccl_world(std::shared_ptr<Comm> mpi_world, Backend& backend) {
  DMUON_CHECK(mpi_world != nullptr, "nccl_world: no MPI communicator to bootstrap from");
  DMUON_CHECK(backend.device() == DeviceKind::cuda, "nccl_world on rank ", mpi_world->rank(), ": the backend is ",
              backend.description(), ", not a CUDA backend");
  const DeviceProperties device = backend.properties();
  const auto queue = static_cast<cudaStream_t>(device.native_queue);
  const Options& options = mpi_world->options();
  DMUON_CHECK(!options.check_calls, "nccl_world: the NCCL communicator does not offer the call-signature check "
              "(unset DMUON_COMM_CHECK)");
  // Rank 0 makes the unique id; the others receive it over MPI.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (mpi_world->rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
  mpi_world->broadcast_raw(&id, sizeof id, DType::u8, 0).wait();
  DMUON_CUDA_CHECK(cudaSetDevice(device.index));
  ncclComm_t comm = nullptr;
  check_nccl(ncclCommInitRank(&comm, mpi_world->size(), id, mpi_world->rank()),
             "ncclCommInitRank on cuda:" + std::to_string(device.index), mpi_world->rank());
  auto world = std::make_shared<NcclComm>(comm, device.index, queue, options, mpi_world->topology(), *mpi_world);
  world->build_groups(mpi_world);
  return world;
}

}  // namespace dmuon::comm
