// Backend-independent parts of the communicator: Work handles (polling, timeout, composition),
// options from the environment, the typed interface's count checks.
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/failure.hpp"
#include "dmuon/comm.hpp"

namespace dmuon::comm {

std::string_view to_string(DType t) {
  switch (t) {
    case DType::f32:
      return "float32";
    case DType::f64:
      return "float64";
    case DType::i64:
      return "int64";
    case DType::u8:
      return "uint8";
  }
  return "?";
}

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::average:
      return "average";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

namespace {
const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

double parse_number(const char* name, const char* text) {
  char* end = nullptr;
  double v = std::strtod(text, &end);
  DMUON_CHECK(end != text && *end == '\0', "environment variable ", name, "='", text, "' is not a number");
  return v;
}
}  // namespace

Options Options::from_env() {
  Options o;
  if (const char* v = env("DMUON_COMM_TIMEOUT_S")) {
    o.timeout_s = parse_number("DMUON_COMM_TIMEOUT_S", v);
    DMUON_CHECK(o.timeout_s > 0, "DMUON_COMM_TIMEOUT_S must be positive, got ", v);
  }
  if (const char* v = env("DMUON_RANKS_PER_NODE")) {
    double n = parse_number("DMUON_RANKS_PER_NODE", v);
    DMUON_CHECK(n >= 1 && n == static_cast<int>(n), "DMUON_RANKS_PER_NODE must be a positive integer, got ", v);
    o.ranks_per_node = static_cast<int>(n);
  }
  if (const char* v = env("DMUON_COMM_CHECK")) o.check_calls = std::string(v) != "0";
  if (const char* v = env("DMUON_COMM_V_ALGO")) {
    std::string s(v);
    DMUON_CHECK(s == "per_owner" || s == "native", "DMUON_COMM_V_ALGO must be native or per_owner, got ", v);
    o.v_algorithm = s == "native" ? VAlgorithm::native : VAlgorithm::per_owner;
  }
  return o;
}

void Comm::check_counts(const char* what, std::span<const int64_t> counts, std::size_t mine, std::size_t total) const {
  DMUON_CHECK(counts.size() == static_cast<std::size_t>(size()), what, " on rank ", rank(), ": ", counts.size(),
              " per-rank counts for ", size(), " ranks");
  int64_t sum = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    DMUON_CHECK(counts[r] >= 0, what, " on rank ", rank(), ": negative count ", counts[r], " for rank ", r);
    sum += counts[r];
  }
  DMUON_CHECK(static_cast<std::size_t>(counts[rank()]) == mine, what, " on rank ", rank(), ": my block has ", mine,
              " elements but counts[", rank(), "] = ", counts[rank()]);
  DMUON_CHECK(static_cast<std::size_t>(sum) == total, what, " on rank ", rank(), ": full buffer has ", total,
              " elements but the counts sum to ", sum);
}

// ---- Work ----

bool Work::test() {
  if (!state_) return true;
  if (!state_->test()) return false;
  state_.reset();
  return true;
}

double Work::wait() {
  using clock = std::chrono::steady_clock;
  if (test()) return 0;
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_);
  // Spin on test(); after a while yield the core, since ranks may outnumber cores.
  for (int polls = 0;; ++polls) {
    if (test()) return std::chrono::duration<double>(clock::now() - start).count();
    if (polls > 1000) std::this_thread::yield();
    if ((polls & 255) == 0 && clock::now() > deadline) {
      detail::mark_comm_failed();
      DMUON_FAIL("dmuon comm: timed out after ", timeout_s_, " s waiting for ", state_->describe(),
                 " (a peer rank died or did not call the same collective; DMUON_COMM_TIMEOUT_S sets the limit)");
    }
  }
}

namespace {
class ThenRun : public WorkState {
 public:
  ThenRun(Work first, std::function<void()> fn, std::string what)
      : first_(std::move(first)), fn_(std::move(fn)), what_(std::move(what)) {}
  bool test() override {
    if (!first_.test()) return false;
    if (fn_) {
      auto fn = std::move(fn_);
      fn_ = nullptr;
      fn();
    }
    return true;
  }
  std::string describe() const override { return what_; }

 private:
  Work first_;
  std::function<void()> fn_;
  std::string what_;
};

class ThenStart : public WorkState {
 public:
  ThenStart(Work first, std::function<Work()> next) : first_(std::move(first)), next_(std::move(next)) {}
  bool test() override {
    if (next_) {
      if (!first_.test()) return false;
      auto next = std::move(next_);
      next_ = nullptr;
      second_ = next();
    }
    return second_.test();
  }
  std::string describe() const override { return next_ ? first_.describe() : second_.describe(); }

 private:
  Work first_;
  std::function<Work()> next_;
  Work second_;
};

class All : public WorkState {
 public:
  explicit All(std::vector<Work> parts) : parts_(std::move(parts)) {}
  bool test() override {
    bool all_done = true;
    for (auto& w : parts_) all_done = w.test() && all_done;
    return all_done;
  }
  std::string describe() const override {
    for (const auto& w : parts_)
      if (!w.done()) return w.describe();
    return "a completed operation";
  }

 private:
  std::vector<Work> parts_;
};
}  // namespace

std::string Work::describe() const { return state_ ? state_->describe() : "a completed operation"; }

Work Work::then_run(Work first, std::function<void()> fn) {
  if (first.test()) {
    fn();
    return Work();
  }
  double timeout = first.timeout_s_;
  std::string what = first.describe();
  return Work(std::make_shared<ThenRun>(std::move(first), std::move(fn), std::move(what)), timeout);
}

Work Work::then_start(Work first, std::function<Work()> next) {
  if (first.test()) return next();
  double timeout = first.timeout_s_;
  return Work(std::make_shared<ThenStart>(std::move(first), std::move(next)), timeout);
}

Work Work::all(std::vector<Work> parts) {
  double timeout = 0;
  for (const auto& w : parts) timeout = std::max(timeout, w.timeout_s_);
  return Work(std::make_shared<All>(std::move(parts)), timeout);
}

}  // namespace dmuon::comm
