// Backend-independent parts of the communicator: Work handles (polling, timeout, composition),
// options from the environment, the typed interface's count checks.
#include <atomic>
#include <cstdlib>
#include <deque>
#include <string>

#include "comm/failure.hpp"
#include "comm/polling.hpp"
#include "dmuon/comm.hpp"

namespace dmuon::comm {

namespace detail {
namespace {
std::atomic<bool> g_failed{false};
}
void mark_comm_failed() { g_failed = true; }
bool comm_failed() { return g_failed; }
}  // namespace detail

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
  if (test()) return 0;
  double waited_s = 0;
  if (detail::poll_until([this] { return test(); }, timeout_s_, waited_s)) return waited_s;
  detail::mark_comm_failed();
  DMUON_FAIL("dmuon comm: timed out after ", timeout_s_, " s waiting for ", state_->describe(),
             " (a peer rank died or did not call the same collective; DMUON_COMM_TIMEOUT_S sets the limit)");
}

bool Work::settle() noexcept {
  try {
    if (test()) return true;
    // The peers may be gone: waiting would only stall the cleanup.
    if (detail::comm_failed()) return false;
    double waited_s = 0;
    if (detail::poll_until([this] { return test(); }, timeout_s_, waited_s)) return true;
  } catch (...) {
    // test() failed. A destructor cannot report it; the caller's original error stands.
  }
  // Abandoned: this rank's collectives no longer match its peers', so the communicator is dead.
  detail::mark_comm_failed();
  return false;
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

}  // namespace

namespace detail {
// Deferred posts on one communicator, in creation order: a post happens only after all earlier
// ones did, so completion order (which differs across ranks) never reorders collectives.
class DeferredPosts {
 public:
  struct Entry {
    Work first;
    std::function<Work()> next;
    Work second;
    bool posted = false;
  };
  std::shared_ptr<Entry> add(Work first, std::function<Work()> next) {
    auto e = std::make_shared<Entry>(Entry{std::move(first), std::move(next), Work(), false});
    queue_.push_back(e);
    return e;
  }
  // Posts every entry at the head whose first stage is complete.
  void drive() {
    while (!queue_.empty() && queue_.front()->first.test()) {
      auto e = queue_.front();
      queue_.pop_front();
      posting = true;
      struct Reset {
        bool& flag;
        ~Reset() { flag = false; }
      } reset{posting};
      auto next = std::move(e->next);
      e->next = nullptr;
      e->second = next();
      e->posted = true;
    }
  }
  bool posting = false;

 private:
  std::deque<std::shared_ptr<Entry>> queue_;
};
}  // namespace detail

namespace {
class ThenStart : public WorkState {
 public:
  ThenStart(detail::DeferredPosts& queue, std::shared_ptr<detail::DeferredPosts::Entry> entry)
      : queue_(queue), entry_(std::move(entry)) {}
  bool test() override {
    queue_.drive();
    return entry_->posted && entry_->second.test();
  }
  std::string describe() const override {
    return entry_->posted         ? entry_->second.describe()
           : entry_->first.done() ? "a deferred post waiting for an earlier one"
                                  : entry_->first.describe();
  }

 private:
  detail::DeferredPosts& queue_;
  std::shared_ptr<detail::DeferredPosts::Entry> entry_;
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

Comm::Comm() : deferred_(std::make_unique<detail::DeferredPosts>()) {}
Comm::~Comm() = default;
bool Comm::posting_deferred() const { return deferred_->posting; }

Work Work::then_start(Work first, Comm& target, std::function<Work()> next) {
  double timeout = first.timeout_s_;
  auto entry = target.deferred_->add(std::move(first), std::move(next));
  target.deferred_->drive();
  return Work(std::make_shared<ThenStart>(*target.deferred_, std::move(entry)), timeout);
}

}  // namespace dmuon::comm
