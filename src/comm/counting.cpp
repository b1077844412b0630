// A Comm decorator that counts each collective's bytes and the time spent inside the communicator
// (include/dmuon/comm.hpp, comm::counting), for the optimizer benchmarks.
#include <chrono>

#include "dmuon/comm.hpp"

namespace dmuon::comm {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The inner Work, with every test() timed into the traffic's blocked time.
class TimedWork : public WorkState {
 public:
  TimedWork(Work inner, std::shared_ptr<Traffic> traffic) : inner_(std::move(inner)), traffic_(std::move(traffic)) {}
  bool test() override {
    const auto t0 = Clock::now();
    const bool done = inner_.test();
    traffic_->blocked_s += since(t0);
    return done;
  }
  std::string describe() const override { return inner_.describe(); }

 private:
  Work inner_;
  std::shared_ptr<Traffic> traffic_;
};

class CountingComm : public Comm {
 public:
  CountingComm(std::shared_ptr<Comm> inner, std::shared_ptr<Traffic> traffic)
      : inner_(std::move(inner)), traffic_(std::move(traffic)) {
    DMUON_CHECK(inner_ && traffic_, "comm::counting needs a communicator and a Traffic");
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const Options& options() const override { return inner_->options(); }
  Comm& node() override { return inner_->node(); }
  Comm& cross() override { return inner_->cross(); }
  const Topology& topology() const override { return inner_->topology(); }
  bool device_buffers() const override { return inner_->device_buffers(); }

  Work all_gather_raw(const void* send, int64_t count, void* recv, DType t) override {
    return post(ring(count * size(), t), [&] { return inner_->all_gather_raw(send, count, recv, t); });
  }
  Work all_gatherv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t) override {
    return post(ring(total(counts), t), [&] { return inner_->all_gatherv_raw(send, recv, counts, t); });
  }
  Work reduce_scatterv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t,
                           ReduceOp op) override {
    return post(ring(total(counts), t), [&] { return inner_->reduce_scatterv_raw(send, recv, counts, t, op); });
  }
  Work broadcast_raw(void* buf, int64_t count, DType t, int root) override {
    return post(ring(count, t), [&] { return inner_->broadcast_raw(buf, count, t, root); });
  }
  Work all_reduce_raw(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override {
    Cost c = ring(count, t);
    c.sent *= 2;  // reduce-scatter then all-gather
    return post(c, [&] { return inner_->all_reduce_raw(send, recv, count, t, op); });
  }

 private:
  struct Cost {
    double payload = 0, sent = 0;
  };
  static int64_t total(std::span<const int64_t> counts) {
    int64_t sum = 0;
    for (int64_t c : counts) sum += c;
    return sum;
  }
  // A ring (or pipelined chain) over n ranks moves (n−1)/n of the buffer out of each rank on average.
  Cost ring(int64_t elements, DType t) const {
    const double bytes = static_cast<double>(elements) * static_cast<double>(dtype_size(t));
    return {bytes, bytes * (size() - 1) / size()};
  }
  template <typename Post>
  Work post(const Cost& cost, Post&& start) {
    const auto t0 = Clock::now();
    Work inner = start();
    traffic_->blocked_s += since(t0);
    ++traffic_->collectives;
    traffic_->payload_bytes += cost.payload;
    traffic_->sent_bytes += cost.sent;
    if (inner.done()) return inner;
    return Work(std::make_shared<TimedWork>(std::move(inner), traffic_), options().timeout_s);
  }

  std::shared_ptr<Comm> inner_;
  std::shared_ptr<Traffic> traffic_;
};

}  // namespace

std::shared_ptr<Comm> counting(std::shared_ptr<Comm> inner, std::shared_ptr<Traffic> traffic) {
  return std::make_shared<CountingComm>(std::move(inner), std::move(traffic));
}

}  // namespace dmuon::comm
