// The gather / release / reduce engine over per-unit packed buffers (see include/dmuon/shard.hpp).
#include <map>

#include "dmuon/shard.hpp"

namespace dmuon::shard {

struct ShardedParams::Unit {
  UnitLayout layout;
  std::vector<int64_t> counts;                                  // per-rank shard sizes
  std::vector<LocalPiece> mine;                                 // layout.local_pieces(my rank)
  // In the backend's memory (ShardOptions::backend):
  Buffer shard;         // my shard of the parameters (sharded modes)
  Buffer packed;        // gathered parameters (replicated: persistent)
  Buffer packed_grads;  // full gradients of this rank, packed order
  Buffer shard_grads;   // reduced gradients of my shard (sharded modes)
  std::map<int, Buffer> split_params, split_grads;             // full copies of multi-segment params
  comm::Work gather_work, reduce_work;
  // Changed only by collective calls, so identical on every rank: the hooks decide from it which
  // collectives to start (completion order may differ across ranks and must not steer them).
  enum class Gather { none, started, ready } gather_state = Gather::none;
  bool is_gathered = false;  // local: packed holds the gathered unit (views valid)
  bool grads_ready = false;  // packed_grads zeroed and writable
  bool reduced = false;      // shard grads valid
  UnitTimes times;
};

namespace {
std::span<float> all_of(const Buffer& b) { return {b.f32(), static_cast<size_t>(b.size())}; }
DeviceSpan<float> view_of(const Buffer& b) { return {*b.backend(), b.f32(), static_cast<size_t>(b.size())}; }

// b holds n values (its memory kept when it already does, else allocated; contents undefined).
void ensure(Buffer& b, Backend& backend, int64_t n) {
  if (b.size() != n || b.backend() != &backend) b = Buffer(backend, DType::f32, n);
}

// b holds n zeros.
void zeros(Buffer& b, Backend& backend, int64_t n) {
  ensure(b, backend, n);
  if (n > 0) backend.fill(b.view(1, n), 0.0f);
}

// Copies parameter p between its full contiguous form and its segments in a packed buffer (backend memory).
void copy_segments(Backend& backend, const std::vector<Segment>& segs, float* packed, float* full, bool to_full) {
  for (const Segment& s : segs) {
    float* in_packed = packed + s.offset_in_packed;
    float* in_full = full + s.offset_in_param;
    if (to_full)
      backend.copy(in_full, in_packed, sizeof(float) * s.length);
    else
      backend.copy(in_packed, in_full, sizeof(float) * s.length);
  }
}
}  // namespace

ShardedParams::ShardedParams(std::shared_ptr<comm::Comm> comm, ParamRegistry registry, ShardOptions options,
                             std::vector<int> owners)
    : comm_(std::move(comm)), registry_(std::move(registry)), options_(options), owners_(std::move(owners)) {
  DMUON_CHECK(comm_ != nullptr, "ShardedParams needs a communicator");
  DMUON_CHECK(backend().host_memory() || comm_->device_buffers(), "sharded parameters on ", backend().description(),
              " need a communicator that takes device memory (NCCL: comm::nccl_world); this one takes host memory "
              "only (MPI)");
  DMUON_CHECK(options_.grad_reduce == ReduceOp::sum || options_.grad_reduce == ReduceOp::average,
              "gradient reduction must be sum or average, got ", to_string(options_.grad_reduce));
  registry_.verify_across(*comm_);
  const auto& specs = registry_.specs();
  const int d = comm_->size();
  if (options_.layout == Layout::owner_aligned) {
    DMUON_CHECK(owners_.size() == specs.size(), "the owner-aligned layout needs an owner per parameter (the planner's, ",
                "plan.hpp): the owner table has ", owners_.size(), " entries for ", specs.size(), " parameters");
  } else {
    DMUON_CHECK(owners_.empty(), "the even layout places no owners, got an owner table of ", owners_.size(),
                " entries");
  }
  for (int u = 0; u < registry_.num_units(); ++u) {
    auto unit = std::make_unique<Unit>();
    unit->layout =
        options_.layout == Layout::even ? even_layout(specs, u, d) : owner_aligned_layout(specs, owners_, u, d);
    unit->counts = unit->layout.shard_sizes();
    unit->mine = unit->layout.local_pieces(comm_->rank());
    if (options_.mode == Mode::replicated) {
      zeros(unit->packed, backend(), unit->layout.total());
      unit->is_gathered = true;
    } else {
      zeros(unit->shard, backend(), unit->layout.shard_size(comm_->rank()));
    }
    for (int p : unit->layout.params)
      if (unit->layout.segments_of(p).size() > 1) zeros(unit->split_params[p], backend(), specs[p].numel());
    units_.push_back(std::move(unit));
  }
}

// Gathers and reduces in flight write into the units' buffers (an exception after
// before_forward(u) leaves unit u+1's gather running). MPI cannot cancel a collective, so settle
// every one (a bounded wait that never throws) before the buffers go; if one cannot complete, the
// units are leaked rather than freed under MPI.
ShardedParams::~ShardedParams() {
  bool settled = true;
  for (auto& u : units_) {
    settled = u->gather_work.settle() && settled;
    settled = u->reduce_work.settle() && settled;
  }
  if (!settled)
    for (auto& u : units_) (void)u.release();
}

ShardedParams::Unit& ShardedParams::unit_at(int unit, const char* what) {
  DMUON_CHECK(unit >= 0 && unit < num_units(), what, ": unit ", unit, " is not in [0, ", num_units(), ")");
  return *units_[unit];
}

const UnitLayout& ShardedParams::layout(int unit) const {
  DMUON_CHECK(unit >= 0 && unit < num_units(), "layout: unit ", unit, " is not in [0, ", num_units(), ")");
  return units_[unit]->layout;
}

std::vector<LocalPiece> ShardedParams::local_pieces(int unit) const { return layout(unit).local_pieces(comm_->rank()); }

DeviceSpan<float> ShardedParams::shard_params(int unit) {
  Unit& u = unit_at(unit, "shard_params");
  if (options_.mode == Mode::replicated)
    return view_of(u.packed).subspan(u.layout.shard_offset[comm_->rank()], u.counts[comm_->rank()]);
  return view_of(u.shard);
}

DeviceSpan<float> ShardedParams::shard_grads(int unit) {
  Unit& u = unit_at(unit, "shard_grads");
  DMUON_CHECK(u.reduced, "shard_grads: unit ", unit, " has no reduced gradients (call reduce_grads and wait)");
  if (options_.mode == Mode::replicated)
    return view_of(u.packed_grads).subspan(u.layout.shard_offset[comm_->rank()], u.counts[comm_->rank()]);
  return view_of(u.shard_grads);
}

LocalPiece ShardedParams::my_piece(int p, const char* what) const {
  DMUON_CHECK(p >= 0 && p < registry_.size(), what, ": parameter index ", p, " out of range");
  LocalPiece found{p, 0, 0, 0};
  int pieces = 0;
  for (const LocalPiece& piece : units_[registry_.specs()[p].unit]->mine) {
    if (piece.param != p) continue;
    found = piece;
    ++pieces;
  }
  DMUON_CHECK(pieces <= 1, what, ": parameter '", registry_.specs()[p].name, "' has ", pieces, " pieces in rank ",
              comm_->rank(), "'s shard; one contiguous piece per rank is expected");
  return found;
}

DeviceSpan<float> ShardedParams::local_params(int p) {
  const LocalPiece piece = my_piece(p, "local_params");
  return shard_params(registry_.specs()[p].unit).subspan(piece.offset_in_shard, piece.length);
}

DeviceSpan<float> ShardedParams::local_grads(int p) {
  const LocalPiece piece = my_piece(p, "local_grads");
  return shard_grads(registry_.specs()[p].unit).subspan(piece.offset_in_shard, piece.length);
}

void ShardedParams::load_full(int param, std::span<const float> values) {
  DMUON_CHECK(param >= 0 && param < registry_.size(), "load_full: parameter index ", param, " out of range");
  const ParamSpec& spec = registry_.specs()[param];
  DMUON_CHECK(static_cast<int64_t>(values.size()) == spec.numel(), "load_full: parameter '", spec.name, "' has ",
              spec.numel(), " elements, got ", values.size());
  Unit& u = *units_[spec.unit];
  Backend& b = backend();
  if (options_.mode == Mode::replicated) {
    for (const Segment& s : u.layout.segments_of(param))
      b.copy_from_host(u.packed.f32() + s.offset_in_packed, values.data() + s.offset_in_param,
                       sizeof(float) * s.length);
    if (u.split_params.count(param)) u.split_params[param].upload(values);
    return;
  }
  for (const LocalPiece& pc : local_pieces(spec.unit))
    if (pc.param == param)
      b.copy_from_host(u.shard.f32() + pc.offset_in_shard, values.data() + pc.offset_in_param,
                       sizeof(float) * pc.length);
}

// ---- operations ----

void ShardedParams::start_gather(Unit& u) {
  DMUON_CHECK(u.gather_state != Unit::Gather::started, "gather: unit ", u.layout.unit, " is already being gathered");
  const int r = comm_->rank();
  if (options_.mode != Mode::replicated) ensure(u.packed, backend(), u.layout.total());  // the gather fills it
  const float* send = options_.mode == Mode::replicated ? u.packed.f32() + u.layout.shard_offset[r] : u.shard.f32();
  comm::Work w = comm_->all_gatherv<float>(std::span<const float>(send, u.counts[r]), all_of(u.packed), u.counts);
  u.gather_state = Unit::Gather::started;
  u.is_gathered = false;
  u.gather_work = comm::Work::then_run(std::move(w), [&u, &b = backend()] {
    for (auto& [p, full] : u.split_params) copy_segments(b, u.layout.segments_of(p), u.packed.f32(), full.f32(), true);
    u.is_gathered = true;
  });
}

comm::Work ShardedParams::gather(int unit) {
  Unit& u = unit_at(unit, "gather");
  start_gather(u);
  return u.gather_work;
}

void ShardedParams::release(int unit) {
  Unit& u = unit_at(unit, "release");
  DMUON_CHECK(u.gather_state != Unit::Gather::started, "release: unit ", unit, " is still being gathered (wait first)");
  u.gather_state = Unit::Gather::none;
  if (options_.mode == Mode::replicated) return;  // the next gather refreshes the owners' updates
  u.is_gathered = false;
  u.packed = Buffer();
}

void ShardedParams::zero_grads(int unit) {
  Unit& u = unit_at(unit, "zero_grads");
  DMUON_CHECK(u.reduce_work.done(), "zero_grads: unit ", unit, " has a reduce in flight (wait first)");
  zeros(u.packed_grads, backend(), u.layout.total());
  for (auto& [p, full] : u.split_params) zeros(u.split_grads[p], backend(), registry_.specs()[p].numel());
  u.grads_ready = true;
  u.reduced = false;
}

comm::Work ShardedParams::reduce_grads(int unit) {
  Unit& u = unit_at(unit, "reduce_grads");
  DMUON_CHECK(u.grads_ready, "reduce_grads: unit ", unit, " has no gradients (call zero_grads and fill them)");
  for (auto& [p, full] : u.split_grads)
    copy_segments(backend(), u.layout.segments_of(p), u.packed_grads.f32(), full.f32(), false);
  u.grads_ready = false;
  comm::Work w;
  const auto op = options_.grad_reduce;
  const int me = comm_->rank();
  // The two-stage reduce permutes blocks in host memory (comm.hpp), so device buffers take one stage.
  const bool two_stage = options_.two_stage && backend().host_memory();
  if (options_.mode == Mode::replicated && two_stage && comm_->topology().two_level()) {
    // Two-stage reduce-scatter to the shards, then an in-place all-gather of the reduced shards:
    // the all-reduce with each byte crossing nodes once per direction.
    ensure(u.shard_grads, backend(), u.counts[me]);
    const int64_t at = u.layout.shard_offset[me];
    w = comm::Work::then_start(comm::reduce_scatterv_two_stage(*comm_, u.packed_grads.f32(), u.shard_grads.f32(),
                                                               u.counts, DType::f32, op),
                               *comm_, [comm = comm_.get(), &b = backend(), &u, at, me] {
                                 b.copy(u.packed_grads.f32() + at, u.shard_grads.f32(),
                                        sizeof(float) * u.shard_grads.size());
                                 return comm->all_gatherv<float>(
                                     std::span<const float>(u.packed_grads.f32() + at, u.counts[me]),
                                     all_of(u.packed_grads), u.counts);
                               });
  } else if (options_.mode == Mode::replicated) {
    w = comm_->all_reduce<float>(all_of(u.packed_grads), op);
  } else {
    ensure(u.shard_grads, backend(), u.counts[me]);
    if (two_stage)
      w = comm::reduce_scatterv_two_stage(*comm_, u.packed_grads.f32(), u.shard_grads.f32(), u.counts,
                                          DType::f32, op);
    else
      w = comm_->reduce_scatterv<float>(all_of(u.packed_grads), all_of(u.shard_grads), u.counts, op);
  }
  const bool keep_full = options_.mode == Mode::replicated;
  u.reduce_work = comm::Work::then_run(std::move(w), [&u, keep_full] {
    if (!keep_full) u.packed_grads = Buffer();
    u.reduced = true;
  });
  return u.reduce_work;
}

void ShardedParams::wait_gather(Unit& u) {
  if (u.gather_state != Unit::Gather::started) return;
  u.gather_state = Unit::Gather::ready;
  if (u.gather_work.done()) return;
  u.times.gather_wait_s += u.gather_work.wait();
  ++u.times.gather_blocks;
}

void ShardedParams::wait_reduce(Unit& u) {
  if (u.reduce_work.done()) return;
  u.times.reduce_wait_s += u.reduce_work.wait();
  ++u.times.reduce_blocks;
}

void ShardedParams::wait(int unit) {
  Unit& u = unit_at(unit, "wait");
  wait_gather(u);
  wait_reduce(u);
}

void ShardedParams::progress() {
  for (auto& u : units_) {
    u->gather_work.test();
    u->reduce_work.test();
  }
}

namespace {
// Full view of parameter p: its own copy if it is cut into several segments, else in place.
DeviceSpan<float> full_view(const UnitLayout& layout, int p, int64_t numel, const Buffer& packed,
                            const std::map<int, Buffer>& split) {
  auto it = split.find(p);
  if (it != split.end()) return view_of(it->second);
  return view_of(packed).subspan(layout.segments_of(p).front().offset_in_packed, numel);
}
}  // namespace

DeviceSpan<float> ShardedParams::param(int p) {
  DMUON_CHECK(p >= 0 && p < registry_.size(), "param: index ", p, " out of range");
  const ParamSpec& spec = registry_.specs()[p];
  Unit& u = *units_[spec.unit];
  DMUON_CHECK(u.is_gathered, "parameter '", spec.name, "' of unit ", spec.unit,
              " is not gathered (call gather and wait, or before_forward/before_backward)");
  return full_view(u.layout, p, spec.numel(), u.packed, u.split_params);
}

DeviceSpan<float> ShardedParams::grad(int p) {
  DMUON_CHECK(p >= 0 && p < registry_.size(), "grad: index ", p, " out of range");
  const ParamSpec& spec = registry_.specs()[p];
  Unit& u = *units_[spec.unit];
  DMUON_CHECK(u.grads_ready, "gradient of '", spec.name, "' (unit ", spec.unit,
              ") is not writable (call zero_grads or before_backward)");
  return full_view(u.layout, p, spec.numel(), u.packed_grads, u.split_grads);
}

bool ShardedParams::gathered(int unit) const {
  DMUON_CHECK(unit >= 0 && unit < num_units(), "gathered: unit ", unit, " is not in [0, ", num_units(), ")");
  return units_[unit]->is_gathered;
}

// ---- hooks ----

void ShardedParams::before_forward(int unit) {
  Unit& u = unit_at(unit, "before_forward");
  // Gradient reduces of the last backward end first: a replicated two-stage reduce posts its
  // all-gather on the world communicator later (deferred), which no gather may overtake.
  if (unit == 0) finish_backward();
  if (u.gather_state == Unit::Gather::none) start_gather(u);
  wait_gather(u);
  if (unit + 1 < num_units() && units_[unit + 1]->gather_state == Unit::Gather::none) start_gather(*units_[unit + 1]);
  progress();
}

void ShardedParams::after_forward(int unit) {
  // z3 frees the unit; replicated keeps the buffer but marks it for a refresh in the next forward.
  if (options_.mode == Mode::z3 || options_.mode == Mode::replicated) release(unit);
  progress();
}

void ShardedParams::before_backward(int unit) {
  Unit& u = unit_at(unit, "before_backward");
  if (options_.mode != Mode::replicated) {
    if (u.gather_state == Unit::Gather::none) start_gather(u);
    wait_gather(u);
    if (options_.mode == Mode::z3 && unit > 0 && units_[unit - 1]->gather_state == Unit::Gather::none)
      start_gather(*units_[unit - 1]);
  }
  wait_reduce(u);  // the previous step's reduce, if the loop skipped finish_backward
  zero_grads(unit);
  progress();
}

void ShardedParams::after_backward(int unit) {
  reduce_grads(unit);
  if (options_.mode != Mode::replicated) release(unit);
  if (unit + 1 < num_units()) wait_reduce(*units_[unit + 1]);
  progress();
}

void ShardedParams::finish_backward() {
  for (auto& u : units_) wait_reduce(*u);
}

const UnitTimes& ShardedParams::times(int unit) const {
  DMUON_CHECK(unit >= 0 && unit < num_units(), "times: unit ", unit, " is not in [0, ", num_units(), ")");
  return units_[unit]->times;
}

void ShardedParams::reset_times() {
  for (auto& u : units_) u->times = UnitTimes{};
}

}  // namespace dmuon::shard
