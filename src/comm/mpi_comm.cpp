// The MPI backend of dmuon::comm::Comm (OpenMPI): non-blocking collectives on a duplicate of
// MPI_COMM_WORLD with MPI_ERRORS_RETURN, node and cross-node groups, the optional call-signature
// handshake. The only file that includes <mpi.h>.
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/collective_checks.hpp"
#include "comm/failure.hpp"
#include "comm/polling.hpp"
#include "dmuon/checksum.hpp"
#include "dmuon/comm.hpp"

namespace dmuon::comm {

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
    case DType::bf16:
      break;
  }
  DMUON_FAIL("the MPI communicator takes no ", to_string(t), " buffers (MPI has no such type)");
}

// average is a sum followed by a division on completion.
MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::average:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  DMUON_FAIL("unknown reduce op");
}

void check_mpi(int rc, const std::string& what, int rank) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = std::snprintf(text, sizeof text, "error code %d", rc);
  detail::mark_comm_failed();
  DMUON_FAIL("MPI ", what, " failed on rank ", rank, ": ", std::string(text, len));
}

int to_int(int64_t n, const char* what, int rank) {
  DMUON_CHECK(n >= 0 && n <= INT_MAX, what, " on rank ", rank, ": count ", n, " is outside MPI's int range");
  return static_cast<int>(n);
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After a failed or timed-out collective the peers may be gone: MPI_Finalize would wait for them.
  if (!finalized && !detail::comm_failed()) MPI_Finalize();
}

void ensure_mpi_initialized() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  DMUON_CHECK(!finalized, "dmuon comm: MPI was already finalized");
  int provided = 0;
  if (!initialized) {
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    DMUON_CHECK(rc == MPI_SUCCESS, "dmuon comm: MPI_Init_thread failed with code ", rc);
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  DMUON_CHECK(provided >= MPI_THREAD_SERIALIZED, "dmuon comm: MPI provides thread level ", provided,
              ", dmuon needs at least MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED, ")");
}

// One posted MPI operation (possibly several requests) plus what it must keep alive.
class MpiWork : public WorkState {
 public:
  MpiWork(std::string what, int rank, int size, double timeout_s)
      : what_(std::move(what)), rank_(rank), size_(size), timeout_s_(timeout_s) {}
  // Dropped before completion: MPI cannot cancel a collective and the peers need our part, so
  // wait for it (bounded by the timeout, never throwing; on_done is skipped, nobody reads the
  // result). Without a live communicator, or past the timeout, abandon it: the requests and the
  // counts MPI may still read are leaked, and the communicator is marked failed.
  ~MpiWork() override {
    if (done_ || requests.empty()) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !detail::comm_failed()) {
      int rc = MPI_SUCCESS, flag = 0;
      double waited_s = 0;
      detail::poll_until(
          [&] {
            rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE);
            return rc != MPI_SUCCESS || flag != 0;
          },
          timeout_s_, waited_s);
      if (rc == MPI_SUCCESS && flag != 0) return;
    }
    detail::mark_comm_failed();
    (void)new std::vector<MPI_Request>(std::move(requests));
    (void)new std::vector<int>(std::move(counts));
    (void)new std::vector<int>(std::move(displs));
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    check_mpi(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE), what_,
              rank_);
    if (!flag) return false;
    done_ = true;
    if (on_done) on_done();
    return true;
  }
  std::string describe() const override {
    return what_ + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  }

  std::vector<MPI_Request> requests;
  std::vector<int> counts, displs;  // MPI reads these until completion
  std::function<void()> on_done;

 private:
  std::string what_;
  int rank_, size_;
  double timeout_s_;
  bool done_ = false;
};

// What a rank is about to call, for the check_calls handshake.
struct Signature {
  int64_t collective, dtype, op, root, count, counts_hash;
};
constexpr const char* kCollectiveNames[] = {"all_gather", "all_gatherv", "reduce_scatterv", "broadcast", "all_reduce"};
enum Collective : int64_t { kAllGather, kAllGatherv, kReduceScatterv, kBroadcast, kAllReduce };

std::string to_string(const Signature& s) {
  std::ostringstream os;
  os << kCollectiveNames[s.collective] << "(" << to_string(static_cast<DType>(s.dtype));
  if (s.collective == kReduceScatterv || s.collective == kAllReduce)
    os << ", " << to_string(static_cast<ReduceOp>(s.op));
  if (s.collective == kBroadcast) os << ", root " << s.root;
  if (s.collective == kAllGatherv || s.collective == kReduceScatterv)
    os << ", per-rank counts hash " << s.counts_hash << ", total " << s.count;
  else
    os << ", count " << s.count;
  return os.str() + ")";
}

int64_t hash_counts(std::span<const int64_t> counts) {
  return static_cast<int64_t>(fnv1a64_values(counts.data(), counts.size()) >> 1);
}

class MpiComm : public Comm {
 public:
  // Takes ownership of `comm`. A world communicator builds its node and cross groups.
  MpiComm(MPI_Comm comm, const Options& options, bool is_world) : comm_(comm), options_(options) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    topology_.rank_at = {rank_};
    if (is_world) build_groups();
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !detail::comm_failed()) MPI_Comm_free(&comm_);
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

  Work all_gather_raw(const void* send, int64_t count, void* recv, DType t) override {
    handshake({kAllGather, int64_t(t), 0, 0, count, 0});
    auto w = start("all_gather");
    check_mpi(MPI_Iallgather(send, to_int(count, "all_gather", rank_), mpi_type(t), recv,
                             to_int(count, "all_gather", rank_), mpi_type(t), comm_, &w->requests.emplace_back()),
              "all_gather (MPI_Iallgather)", rank_);
    return finish(std::move(w));
  }

  Work all_gatherv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t) override {
    int64_t total = fill_counts_displs(counts, "all_gatherv");
    handshake({kAllGatherv, int64_t(t), 0, 0, total, hash_counts(counts)});
    auto w = start("all_gatherv");
    fill_counts_displs_into(*w, counts);
    const std::size_t esize = dtype_size(t);
    char* out = static_cast<char*>(recv);
    char* mine = out + esize * static_cast<std::size_t>(w->displs[rank_]);
    const bool in_place = send == mine;
    if (options_.v_algorithm == VAlgorithm::native) {
      check_mpi(MPI_Iallgatherv(in_place ? MPI_IN_PLACE : send, w->counts[rank_], mpi_type(t), recv, w->counts.data(),
                                w->displs.data(), mpi_type(t), comm_, &w->requests.emplace_back()),
                "all_gatherv (MPI_Iallgatherv)", rank_);
    } else {
      if (!in_place && w->counts[rank_] > 0) std::memcpy(mine, send, esize * w->counts[rank_]);
      for (int r = 0; r < size_; ++r) {
        if (w->counts[r] == 0) continue;
        check_mpi(MPI_Ibcast(out + esize * static_cast<std::size_t>(w->displs[r]), w->counts[r], mpi_type(t), r, comm_,
                             &w->requests.emplace_back()),
                  "all_gatherv (per-owner MPI_Ibcast from rank " + std::to_string(r) + ")", rank_);
      }
    }
    return finish(std::move(w));
  }

  Work reduce_scatterv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t,
                           ReduceOp op) override {
    check_op(t, op, "reduce_scatterv");
    int64_t total = fill_counts_displs(counts, "reduce_scatterv");
    handshake({kReduceScatterv, int64_t(t), int64_t(op), 0, total, hash_counts(counts)});
    auto w = start("reduce_scatterv");
    fill_counts_displs_into(*w, counts);
    if (options_.v_algorithm == VAlgorithm::native) {
      check_mpi(MPI_Ireduce_scatter(send, recv, w->counts.data(), mpi_type(t), mpi_op(op), comm_,
                                    &w->requests.emplace_back()),
                "reduce_scatterv (MPI_Ireduce_scatter)", rank_);
    } else {
      const std::size_t esize = dtype_size(t);
      const char* in = static_cast<const char*>(send);
      for (int r = 0; r < size_; ++r) {
        if (w->counts[r] == 0) continue;
        check_mpi(MPI_Ireduce(in + esize * static_cast<std::size_t>(w->displs[r]), r == rank_ ? recv : nullptr,
                              w->counts[r], mpi_type(t), mpi_op(op), r, comm_, &w->requests.emplace_back()),
                  "reduce_scatterv (per-owner MPI_Ireduce to rank " + std::to_string(r) + ")", rank_);
      }
    }
    if (op == ReduceOp::average) w->on_done = scale_by_size(recv, counts[rank_], t);
    return finish(std::move(w));
  }

  Work broadcast_raw(void* buf, int64_t count, DType t, int root) override {
    check_root(root, "broadcast");
    handshake({kBroadcast, int64_t(t), 0, root, count, 0});
    auto w = start("broadcast");
    check_mpi(MPI_Ibcast(buf, to_int(count, "broadcast", rank_), mpi_type(t), root, comm_, &w->requests.emplace_back()),
              "broadcast (MPI_Ibcast)", rank_);
    return finish(std::move(w));
  }

  Work all_reduce_raw(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override {
    check_op(t, op, "all_reduce");
    handshake({kAllReduce, int64_t(t), int64_t(op), 0, count, 0});
    auto w = start("all_reduce");
    check_mpi(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, to_int(count, "all_reduce", rank_), mpi_type(t),
                             mpi_op(op), comm_, &w->requests.emplace_back()),
              "all_reduce (MPI_Iallreduce)", rank_);
    if (op == ReduceOp::average) w->on_done = scale_by_size(recv, count, t);
    return finish(std::move(w));
  }

 private:
  std::shared_ptr<MpiWork> start(const char* what) {
    return std::make_shared<MpiWork>(what, rank_, size_, options_.timeout_s);
  }
  Work finish(std::shared_ptr<MpiWork> w) { return Work(std::move(w), options_.timeout_s); }

  void check_root(int root, const char* what) const { detail::check_root(root, size_, rank_, what); }
  void check_op(DType t, ReduceOp op, const char* what) const { detail::check_reduce_op(t, op, rank_, what); }
  int64_t fill_counts_displs(std::span<const int64_t> counts, const char* what) const {
    const int64_t total = detail::check_per_rank_counts(counts, size_, rank_, what);
    to_int(total, what, rank_);  // displacements are ints too
    return total;
  }
  void fill_counts_displs_into(MpiWork& w, std::span<const int64_t> counts) const {
    int displ = 0;
    for (int64_t c : counts) {
      w.counts.push_back(static_cast<int>(c));
      w.displs.push_back(displ);
      displ += static_cast<int>(c);
    }
  }
  std::function<void()> scale_by_size(void* buf, int64_t count, DType t) const {
    const int n = size_;
    if (t == DType::f32)
      return [buf, count, n] {
        float* p = static_cast<float*>(buf);
        for (int64_t i = 0; i < count; ++i) p[i] /= static_cast<float>(n);
      };
    return [buf, count, n] {
      double* p = static_cast<double*>(buf);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
    };
  }

  // With options_.check_calls: every rank learns every rank's signature; all throw on a mismatch.
  void handshake(const Signature& mine) {
    if (!options_.check_calls || size_ == 1 || posting_deferred()) return;
    std::vector<Signature> all(size_);
    auto w = start("call-signature check (DMUON_COMM_CHECK)");
    check_mpi(MPI_Iallgather(&mine, 6, MPI_INT64_T, all.data(), 6, MPI_INT64_T, comm_, &w->requests.emplace_back()),
              "call-signature check", rank_);
    finish(std::move(w)).wait();
    for (int r = 1; r < size_; ++r) {
      if (std::memcmp(&all[r], &all[0], sizeof(Signature)) != 0)
        DMUON_FAIL("collective calls differ across ranks (seen on rank ", rank_, "): rank 0 called ", to_string(all[0]),
                   " but rank ", r, " called ", to_string(all[r]));
    }
  }

  void build_groups() {
    MPI_Comm node = MPI_COMM_NULL, cross = MPI_COMM_NULL;
    if (options_.ranks_per_node > 0)
      check_mpi(MPI_Comm_split(comm_, rank_ / options_.ranks_per_node, rank_, &node), "MPI_Comm_split (node)", rank_);
    else
      check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node),
                "MPI_Comm_split_type (node)", rank_);
    int local = 0;
    MPI_Comm_rank(node, &local);
    check_mpi(MPI_Comm_split(comm_, local, rank_, &cross), "MPI_Comm_split (cross-node)", rank_);
    node_ = std::make_unique<MpiComm>(node, options_, false);
    cross_ = std::make_unique<MpiComm>(cross, options_, false);

    // Everyone learns (node index, local index, node size) of everyone.
    int64_t mine[3] = {cross_->rank(), node_->rank(), node_->size()};
    std::vector<int64_t> all(3 * static_cast<std::size_t>(size_));
    all_gather<int64_t>(mine, all).wait();
    const int per_node = node_->size();
    const int nodes = cross_->size();
    topology_ = Topology{nodes, per_node, nodes * per_node == size_, {}};
    for (int r = 0; r < size_; ++r)
      if (all[3 * r + 2] != per_node) topology_.uniform = false;
    if (topology_.uniform) {
      topology_.rank_at.assign(size_, -1);
      for (int r = 0; r < size_; ++r) topology_.rank_at[all[3 * r] * per_node + all[3 * r + 1]] = r;
    }
  }

  MPI_Comm comm_;
  Options options_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<MpiComm> node_, cross_;
  Topology topology_;
};

}  // namespace

std::shared_ptr<Comm> world(const Options& options) {
  ensure_mpi_initialized();
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  DMUON_CHECK(rc == MPI_SUCCESS, "dmuon comm: MPI_Comm_dup(MPI_COMM_WORLD) failed with code ", rc);
  return std::make_shared<MpiComm>(dup, options, true);
}

std::shared_ptr<Comm> self(const Options& options) {
  ensure_mpi_initialized();
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_SELF, &dup);
  DMUON_CHECK(rc == MPI_SUCCESS, "dmuon comm: MPI_Comm_dup(MPI_COMM_SELF) failed with code ", rc);
  return std::make_shared<MpiComm>(dup, options, true);
}

void abort_world(int exit_code, double grace_s) {
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size <= 1) return;
  std::fflush(nullptr);  // the caller's error line must reach mpirun before the job is torn down
  if (grace_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
  MPI_Abort(MPI_COMM_WORLD, exit_code);
}

}  // namespace dmuon::comm
