// Communicator: non-blocking collectives across ranks behind one interface. The MPI communicator
// (or, built without MPI, a world of one) lives in src/comm; the NCCL communicator on GPU buffers in
// src/nccl (comm_nccl.hpp) implements the same Comm class. Code above them (src/shard, the
// optimizers) includes only this header, never <mpi.h> or <nccl.h>.
//
// Contracts, for every collective of a Comm:
//  - Call order. Every rank of the communicator calls the same collectives in the same order, with
//    the same dtype, op, root and per-rank counts. MPI cannot see a mismatch (it hangs or
//    corrupts). What is checked:
//      always, locally: buffer sizes agree with the counts (recv = Σ counts, counts[rank] = send
//        size, counts.size() = size(), root in range, average only on floating dtypes);
//      with Options::check_calls (env DMUON_COMM_CHECK=1): before each collective the ranks
//        all-gather a signature (collective, dtype, op, root, count, hash of per-rank counts) and
//        every rank throws the same Error naming the first rank whose call differs from rank 0's.
//        This catches mixed dtypes and disagreeing counts; it costs one small blocking all-gather.
//  - Threads. One thread at a time uses a Comm and its Work handles. MPI must provide at least
//    MPI_THREAD_SERIALIZED; world() initialises MPI with that level if nobody has (the tests'
//    main asks for the same level, so they run what production runs).
//  - Buffers. send, recv and counts must stay alive and unmodified until the Work completes.
//  - Destruction. MPI cannot cancel a non-blocking collective (MPI_Cancel and MPI_Request_free
//    are erroneous on one) and the peers need this rank's part of it, so an operation whose last
//    Work handle is dropped before it completes is waited for in the destructor (polling, bounded
//    by the timeout, never throwing); an owner of buffers calls Work::settle() before freeing
//    them. Where waiting cannot help (the communicator already failed or the wait times out) the
//    operation is abandoned and what MPI may still write into is leaked, never freed.
//  - Progress: by polling. Work::test() advances the operation (MPI_Test); Work::wait() polls until
//    done. There is no progress thread: OpenMPI 4.1's shared-memory and TCP transports move large
//    messages only inside MPI calls, so a training loop calls test() on in-flight work at known
//    points (the shard hooks do this, and ShardedParams::progress() may be called from compute).
//    Why: a progress thread needs MPI_THREAD_MULTIPLE (slower locking in every call) and takes a
//    core from compute on small machines; `dmuon bench comm` reports the exposed wait of an
//    all-gather overlapped with compute, with and without polling, which is the measurement
//    behind this choice.
//  - Errors. MPI errors are returned (MPI_ERRORS_RETURN) and become dmuon::Error naming the
//    collective, the rank and MPI_Error_string.
//  - Timeouts. wait() gives up after Options::timeout_s (env DMUON_COMM_TIMEOUT_S, default 300 s)
//    and throws an Error ("timed out ... waiting for <collective> on rank r of n"). A peer that
//    died or never calls the collective thus turns into an error on every rank that waits for
//    it; the communicator is then unusable, MPI is not finalised at exit, and mpirun tears down
//    the job when the CLI exits non-zero.
//  - One rank failing alone. A rank whose error escapes to the program's top level must not
//    return from main() while its peers wait in a collective (the exit handler's MPI_Finalize
//    would block with them until their timeout): the CLI prints the error and calls
//    abort_world(), which ends every rank at once. Library code never aborts; it throws.
//  - Counts are element counts (int64 in the API; the MPI backend refuses counts over INT_MAX).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dmuon/dtype.hpp"
#include "dmuon/error.hpp"

namespace dmuon::comm {

// How all-gather(v) and reduce-scatter(v) with uneven per-rank counts run (DESIGN 3.1).
//  native: MPI_Iallgatherv / MPI_Ireduce_scatter as OpenMPI implements them (ring-like for large
//    messages on a network: about (D−1)·max_block / bandwidth when blocks are uneven).
//  per_owner: one broadcast from each rank with a non-empty block (gather) / one reduce to it
//    (reduce-scatter), all posted at once; each costs about its own bytes / bandwidth, so one
//    large block does not pace D−1 ring steps.
// The default is native, the plain MPI call: on the shared 2-core development machine (OpenMPI
// 4.1, shared memory, 2 and 4 ranks, 1–64 MiB) the uneven rows of `dmuon bench comm` put the two
// within run-to-run noise of each other (repeated runs differed by up to 2×), with no consistent
// winner. The ring effect that per_owner avoids is a network effect: re-measure on a cluster.
enum class VAlgorithm { native, per_owner };

struct Options {
  double timeout_s = 300;    // a wait longer than this throws; env DMUON_COMM_TIMEOUT_S
  int ranks_per_node = 0;    // 0: real nodes (MPI_COMM_TYPE_SHARED); N: ranks [kN, (k+1)N) form node k;
                             // env DMUON_RANKS_PER_NODE
  bool check_calls = false;  // signature handshake before each collective; env DMUON_COMM_CHECK=1
  VAlgorithm v_algorithm = VAlgorithm::native;  // env DMUON_COMM_V_ALGO=native|per_owner
  // Defaults overridden by the environment variables above; malformed values throw.
  static Options from_env();
};

class Comm;

// One in-flight operation's backend state.
class WorkState {
 public:
  virtual ~WorkState() = default;
  // Advances the operation; true once it is complete. Throws dmuon::Error on failure.
  virtual bool test() = 0;
  // "all_gatherv on rank 1 of 4", for error messages.
  virtual std::string describe() const = 0;
};

// Handle of a non-blocking operation. A default-constructed Work is already complete.
class Work {
 public:
  Work() = default;
  Work(std::shared_ptr<WorkState> state, double timeout_s) : state_(std::move(state)), timeout_s_(timeout_s) {}

  // Advances the operation without blocking; true once complete (then stays true).
  bool test();
  // Polls until complete; throws dmuon::Error after the timeout. Returns the seconds it waited.
  double wait();
  // For destructors and cleanup: completes the operation like wait() but never throws. Returns
  // true once it completed; false (without waiting) if the communicator already failed, or when
  // it fails or times out now (the communicator is then marked failed). On false the operation
  // may still write into its buffers: the caller must leak them rather than free them.
  bool settle() noexcept;
  bool done() const { return state_ == nullptr; }
  // What the operation is and where, for messages ("all_gatherv on rank 1 of 4").
  std::string describe() const;

  // Runs `fn` once `first` completes (inside its test()/wait()), e.g. scaling by 1/n or unpacking.
  static Work then_run(Work first, std::function<void()> fn);
  // Posts the operation made by `next` on `target` once `first` completes; done when that one
  // is. Such deferred posts on one communicator happen in the order then_start was called (a
  // later one waits for the earlier ones to be posted), so every rank posts them in the same
  // order whatever order its operations complete in. A communicator that receives deferred posts
  // must receive no other (eagerly posted) operations while they are pending.
  static Work then_start(Work first, Comm& target, std::function<Work()> next);

 private:
  std::shared_ptr<WorkState> state_;
  double timeout_s_ = 0;
};

// Where ranks sit: node k = 0..nodes-1 (index within the cross group), local index j = 0..L-1
// (index within the node group). uniform: every node has the same number of ranks, so the
// cross groups are complete and rank_at[k·L + j] is the world rank at (k, j).
struct Topology {
  int nodes = 1;
  int ranks_per_node = 1;
  bool uniform = true;
  std::vector<int> rank_at;
  // Two-stage collectives help only with several nodes of several ranks each.
  bool two_level() const { return uniform && nodes > 1 && ranks_per_node > 1; }
};

namespace detail {
class DeferredPosts;
}

class Comm {
 public:
  Comm();
  virtual ~Comm();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const Options& options() const = 0;
  // Ranks of my node, and ranks with my node-local index (one per node); defined on a world
  // communicator (Error on a sub-group).
  virtual Comm& node() = 0;
  virtual Comm& cross() = 0;
  virtual const Topology& topology() const = 0;
  // Whether the collectives also take device memory of a GPU backend (NCCL, which sends host buffers over the
  // MPI communicator it was made from); false: host memory only (MPI).
  virtual bool device_buffers() const { return false; }

  // ---- untyped interface: a backend implements these (counts in elements of dtype) ----
  // recv (size()·count) = concatenation of every rank's send (count).
  virtual Work all_gather_raw(const void* send, int64_t count, void* recv, DType t) = 0;
  // recv (Σ counts) = concatenation of every rank's send (counts[r] on rank r).
  virtual Work all_gatherv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t) = 0;
  // send (Σ counts) reduced elementwise over ranks; rank r receives block r (counts[r]).
  virtual Work reduce_scatterv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t,
                                   ReduceOp op) = 0;
  virtual Work broadcast_raw(void* buf, int64_t count, DType t, int root) = 0;
  // send == recv reduces in place.
  virtual Work all_reduce_raw(const void* send, void* recv, int64_t count, DType t, ReduceOp op) = 0;

  // ---- typed interface: sizes checked here, dtype from T ----
  template <typename T>
  Work all_gather(std::span<const T> send, std::span<T> recv) {
    DMUON_CHECK(recv.size() == send.size() * static_cast<std::size_t>(size()), "all_gather on rank ", rank(),
                ": recv has ", recv.size(), " elements, expected ", size(), " x ", send.size());
    return all_gather_raw(send.data(), static_cast<int64_t>(send.size()), recv.data(), dtype_of<T>());
  }
  template <typename T>
  Work all_gatherv(std::span<const T> send, std::span<T> recv, std::span<const int64_t> counts) {
    check_counts("all_gatherv", counts, send.size(), recv.size());
    return all_gatherv_raw(send.data(), recv.data(), counts, dtype_of<T>());
  }
  // Equal blocks: recv has send.size() / size() elements.
  template <typename T>
  Work reduce_scatter(std::span<const T> send, std::span<T> recv, ReduceOp op) {
    DMUON_CHECK(send.size() == recv.size() * static_cast<std::size_t>(size()), "reduce_scatter on rank ", rank(),
                ": send has ", send.size(), " elements, expected ", size(), " x ", recv.size());
    std::vector<int64_t> counts(size(), static_cast<int64_t>(recv.size()));
    return reduce_scatterv_raw(send.data(), recv.data(), counts, dtype_of<T>(), op);
  }
  template <typename T>
  Work reduce_scatterv(std::span<const T> send, std::span<T> recv, std::span<const int64_t> counts, ReduceOp op) {
    check_counts("reduce_scatterv", counts, recv.size(), send.size());
    return reduce_scatterv_raw(send.data(), recv.data(), counts, dtype_of<T>(), op);
  }
  template <typename T>
  Work broadcast(std::span<T> buf, int root) {
    return broadcast_raw(buf.data(), static_cast<int64_t>(buf.size()), dtype_of<T>(), root);
  }
  template <typename T>
  Work all_reduce(std::span<const T> send, std::span<T> recv, ReduceOp op) {
    DMUON_CHECK(recv.size() == send.size(), "all_reduce on rank ", rank(), ": recv has ", recv.size(),
                " elements, send ", send.size());
    return all_reduce_raw(send.data(), recv.data(), static_cast<int64_t>(send.size()), dtype_of<T>(), op);
  }
  template <typename T>
  Work all_reduce(std::span<T> inout, ReduceOp op) {
    return all_reduce_raw(inout.data(), inout.data(), static_cast<int64_t>(inout.size()), dtype_of<T>(), op);
  }

 private:
  void check_counts(const char* what, std::span<const int64_t> counts, std::size_t mine, std::size_t total) const;

 protected:
  // True while a deferred post (Work::then_start) runs: a backend must not block there (its
  // call-signature check is skipped; the arguments derive from a call that was checked).
  bool posting_deferred() const;

 private:
  friend class Work;
  std::unique_ptr<detail::DeferredPosts> deferred_;
};

// The world communicator (a fresh duplicate of MPI_COMM_WORLD with its node and cross groups).
// Initialises MPI (MPI_THREAD_SERIALIZED) if nobody has and finalises it at exit unless a
// collective failed; without mpirun a lone process is a world of one. Collective over all ranks.
std::shared_ptr<Comm> world(const Options& options = Options::from_env());

// A world of one: this process alone (a duplicate of MPI_COMM_SELF, with trivial node and cross groups),
// however many ranks mpirun started. Single-process runs take it, so that one rank goes through the
// same code as many (the Trainer without a communicator; single-process references in the tests).
// Initialises MPI as world() does. Not collective.
std::shared_ptr<Comm> self(const Options& options = Options::from_env());

// For a program's top level after it printed an error: with MPI initialised and more than one
// rank in MPI_COMM_WORLD, ends every rank of the job now (MPI_Abort) with `exit_code`; otherwise
// (a world of one, MPI not initialised or already finalised) returns and the caller exits. With
// grace_s > 0 it first waits that long for another rank to end the job (a rank that saw PeerFailed
// lets the failing rank print its error and abort first).
void abort_world(int exit_code, double grace_s = 0);

// Reduce-scatter(v) in two stages when the topology has several nodes of several ranks: a
// reduce-scatter inside each node, then one across nodes among ranks with the same local index,
// so each byte crosses nodes once. Falls back to comm.reduce_scatterv_raw otherwise. Same
// contract as reduce_scatterv_raw; the sum order differs from the flat call (equal bit for bit
// only where float addition is exact, e.g. integer-valued data).
Work reduce_scatterv_two_stage(Comm& world, const void* send, void* recv, std::span<const int64_t> counts, DType t,
                               ReduceOp op);

}  // namespace dmuon::comm

namespace dmuon::comm {

// What the collectives issued through a counting communicator cost this rank (benchmarks).
//   payload_bytes: Σ over collectives of the whole buffer's bytes (all-gather(v): recv; reduce-scatter(v):
//     send; all-reduce, broadcast: the buffer).
//   sent_bytes: Σ of the bytes each rank sends, on average over ranks, when the collective runs as a ring
//     (all-gather(v), reduce-scatter(v): (n−1)/n · payload; all-reduce: 2(n−1)/n · payload) or a pipelined
//     chain (broadcast: (n−1)/n · payload): exact arithmetic on the sizes, the nccl-tests bus-bandwidth
//     convention. What the MPI library's chosen algorithm actually puts on the wire may differ.
//   blocked_s: seconds this rank spent inside the communicator (posting, and every test()/wait() of the
//     returned Work until it completed): communication the caller did not hide behind compute.
struct Traffic {
  int64_t collectives = 0;
  double payload_bytes = 0;
  double sent_bytes = 0;
  double blocked_s = 0;
};

// A communicator that forwards every collective to `inner` and adds its cost to `traffic`. node() and
// cross() are the inner ones (not counted; two-stage reduces need DMUON_RANKS_PER_NODE, off by default).
std::shared_ptr<Comm> counting(std::shared_ptr<Comm> inner, std::shared_ptr<Traffic> traffic);

}  // namespace dmuon::comm
