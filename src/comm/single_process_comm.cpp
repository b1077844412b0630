// The communicator of builds without MPI (-DDMUON_MPI=OFF, as the Python package's C ABI library is
// built): world() and self() are this process alone. Every collective over one rank is a copy (or
// nothing) that is complete when posted; the argument checks are those of the MPI backend.
#include <cstring>
#include <memory>

#include "comm/collective_checks.hpp"
#include "dmuon/comm.hpp"

namespace dmuon::comm {

namespace {

class SingleProcessComm final : public Comm {
 public:
  explicit SingleProcessComm(const Options& options) : options_(options) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  const Options& options() const override { return options_; }
  Comm& node() override { return *this; }
  Comm& cross() override { return *this; }
  const Topology& topology() const override { return topology_; }

  Work all_gather_raw(const void* send, int64_t count, void* recv, DType t) override {
    return copy(send, recv, count, t);
  }
  Work all_gatherv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t) override {
    return copy(send, recv, detail::check_per_rank_counts(counts, 1, 0, "all_gatherv"), t);
  }
  Work reduce_scatterv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t,
                           ReduceOp op) override {
    detail::check_reduce_op(t, op, 0, "reduce_scatterv");
    return copy(send, recv, detail::check_per_rank_counts(counts, 1, 0, "reduce_scatterv"), t);
  }
  Work broadcast_raw(void*, int64_t, DType, int root) override {
    detail::check_root(root, 1, 0, "broadcast");
    return {};
  }
  Work all_reduce_raw(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override {
    detail::check_reduce_op(t, op, 0, "all_reduce");
    return copy(send, recv, count, t);
  }

 private:
  // The reduction (or gather) over one rank: recv = send; in place when they are one buffer.
  static Work copy(const void* send, void* recv, int64_t count, DType t) {
    if (count > 0 && send != recv) std::memcpy(recv, send, static_cast<std::size_t>(count) * dtype_size(t));
    return {};
  }

  Options options_;
  Topology topology_;
};

}  // namespace

std::shared_ptr<Comm> world(const Options& options) { return std::make_shared<SingleProcessComm>(options); }

std::shared_ptr<Comm> self(const Options& options) { return std::make_shared<SingleProcessComm>(options); }

void abort_world(int, double) {}

}  // namespace dmuon::comm
