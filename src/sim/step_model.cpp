// One training step on the simulated cluster: a compute stream and a communication stream per
// device, events placed in the order a sharded training loop issues them (see sim.hpp).
#include <algorithm>
#include <map>

#include "dmuon/error.hpp"
#include "dmuon/sim.hpp"

namespace dmuon::sim {

namespace {

// Per unit: parameter counts and which rank owns how many of its Muon elements.
struct UnitShape {
  double params = 0;       // all elements
  double elementwise = 0;  // AdamW elements (evenly sharded)
  std::map<int, double> owned_matrix_elements;  // owner rank -> elements of its matrices in this unit
};

std::vector<UnitShape> unit_shapes(const std::vector<ParamSpec>& params, const std::vector<int>& owner) {
  int units = 0;
  for (const auto& p : params) units = std::max(units, p.unit + 1);
  std::vector<UnitShape> out(units);
  for (size_t i = 0; i < params.size(); ++i) {
    UnitShape& u = out[params[i].unit];
    const double n = static_cast<double>(params[i].numel());
    u.params += n;
    if (params[i].role == ParamRole::matrix) u.owned_matrix_elements[owner[i]] += n;
    else u.elementwise += n;
  }
  return out;
}

// The single communication stream: operations run one at a time in issue order.
class CommStream {
 public:
  double run(double ready_s, double duration_s) {
    const double start = std::max(ready_s, free_at_);
    free_at_ = start + duration_s;
    busy_ += duration_s;
    return free_at_;
  }
  double busy_s() const { return busy_; }

 private:
  double free_at_ = 0;
  double busy_ = 0;
};

struct UnitComm {
  double gather_s = 0;
  double reduce_s = 0;
};

// Forward gathers, backward (re-gathers under Z3 and) reduce-scatters, overlapped with compute.
// Returns {end of backward and of the last reduce-scatter, compute time}.
std::pair<double, double> overlapped_fwd_bwd(const std::vector<UnitShape>& units, const std::vector<UnitComm>& comm,
                                             const HardwareProfile& hw, double tokens, bool zero3) {
  const size_t n = units.size();
  const double rate = hw.peak_flops * hw.mfu;
  std::vector<double> fwd(n), bwd(n);
  double compute = 0;
  for (size_t i = 0; i < n; ++i) {
    fwd[i] = 2 * units[i].params * tokens / rate;
    bwd[i] = 2 * fwd[i];
    compute += fwd[i] + bwd[i];
  }
  CommStream stream;
  // Forward: gather(i+1) is issued when unit i starts computing.
  double compute_free = 0;
  double gathered = stream.run(0, comm[0].gather_s);
  for (size_t i = 0; i < n; ++i) {
    const double start = std::max(compute_free, gathered);
    if (i + 1 < n) gathered = stream.run(start, comm[i + 1].gather_s);
    compute_free = start + fwd[i];
  }
  // Backward, last unit first: its weights are still gathered; under Z3 unit i−1 is gathered again
  // while unit i computes, and unit i's gradients are reduce-scattered once it is done.
  double last_reduce = 0;
  gathered = compute_free;
  for (size_t k = n; k-- > 0;) {
    const double start = std::max(compute_free, gathered);
    if (k > 0) gathered = zero3 ? stream.run(start, comm[k - 1].gather_s) : start;
    compute_free = start + bwd[k];
    last_reduce = stream.run(compute_free, comm[k].reduce_s);
  }
  return {std::max(compute_free, last_reduce), compute};
}

// AdamW over `elements`: read p, g, m, v, write p, m, v in float32 (HBM-bound), one fused launch.
double adamw_time_s(double elements, const HardwareProfile& hw) {
  return elements * 7 * 4 / hw.hbm_bytes_per_s + hw.kernel_launch_s;
}
// Muon's elementwise part on `elements`: momentum lerp, Nesterov blend, decay and update.
double muon_elementwise_time_s(double elements, const HardwareProfile& hw) {
  return elements * 6 * 4 / hw.hbm_bytes_per_s + 2 * hw.kernel_launch_s;
}

}  // namespace

std::string to_string(Optimizer o) {
  switch (o) {
    case Optimizer::adamw: return "adamw";
    case Optimizer::muon_gather_plain: return "muon-gather-plain";
    case Optimizer::muon_gather: return "muon-gather";
    case Optimizer::dmuon: return "dmuon";
  }
  return "?";
}

const std::vector<Optimizer>& all_optimizers() {
  static const std::vector<Optimizer> all = {Optimizer::adamw, Optimizer::muon_gather_plain, Optimizer::muon_gather,
                                             Optimizer::dmuon};
  return all;
}

SimResult simulate_step(const std::vector<ParamSpec>& params, const HardwareProfile& hw, const Topology& topology,
                        const SimOptions& options) {
  DMUON_CHECK(!params.empty(), "simulate_step: the model has no parameters");
  DMUON_CHECK(options.tokens_per_device > 0, "tokens per device must be positive, got ", options.tokens_per_device);
  const int d = topology.devices;
  const Link link = world_link(hw, topology);
  const double elem_bytes = hw.comm_bytes_per_element;

  SimResult result;
  result.devices = d;
  const BatchTimeFn dmuon_batch_time = [&hw](int64_t rows, int64_t cols, int batch) {
    return ns_time_s(rows, cols, batch, NsEngine::dmuon, hw);
  };
  const std::vector<PlanItem> items = make_plan_items(params, d, dmuon_batch_time);
  result.plan = make_plan(params, items, d, options.plan);

  // Totals over the model.
  double matrix_elements = 0, elementwise_elements = 0, plain_ns = 0;
  std::map<std::pair<int64_t, int64_t>, int> shape_count;
  for (const auto& p : params) {
    if (p.role == ParamRole::matrix) {
      matrix_elements += static_cast<double>(p.numel());
      plain_ns += ns_time_s(p.rows(), p.cols(), 1, NsEngine::plain, hw);
      ++shape_count[{p.rows(), p.cols()}];
    } else {
      elementwise_elements += static_cast<double>(p.numel());
    }
  }
  double engine_ns = 0;
  for (const auto& [shape, count] : shape_count) engine_ns += dmuon_batch_time(shape.first, shape.second, count);

  // FSDP's even layout (AdamW and both gather-then-compute baselines).
  const std::vector<int> no_owner(params.size(), 0);
  const std::vector<UnitShape> even_units = unit_shapes(params, no_owner);
  std::vector<UnitComm> even_comm;
  double unit_bytes_total = 0;
  for (const auto& u : even_units) {
    const double bytes = u.params * elem_bytes;
    unit_bytes_total += bytes;
    even_comm.push_back({ring_all_gather_s(bytes, d, link), ring_reduce_scatter_s(bytes, d, link)});
  }
  const auto [even_end, compute] = overlapped_fwd_bwd(even_units, even_comm, hw, options.tokens_per_device,
                                                      options.zero3);
  const double fsdp_bytes = unit_bytes_total * (d - 1.0) / d * (options.zero3 ? 3 : 2);

  // DMuon's owner-aligned layout: one pipelined broadcast (forward) and one two-stage reduce
  // (backward) per owner of the unit's matrices, plus an even gather / reduce-scatter of the
  // unit's AdamW elements.
  const std::vector<UnitShape> owned_units = unit_shapes(params, result.plan.owner);
  const int per_node = std::min(d, topology.devices_per_node);
  const Link nvlink{hw.intra_node_bytes_per_s, hw.intra_node_latency_s};
  const Link nic{hw.inter_node_bytes_per_s / per_node, hw.inter_node_latency_s};
  std::vector<UnitComm> owned_comm;
  for (const auto& u : owned_units) {
    UnitComm c{ring_all_gather_s(u.elementwise * elem_bytes, d, link),
               two_stage_reduce_scatter_s(u.elementwise * elem_bytes, hw, topology)};
    for (const auto& [rank, elements] : u.owned_matrix_elements) {
      const double bytes = elements * elem_bytes;
      c.gather_s += pipelined_broadcast_s(bytes, d, link);
      c.reduce_s += pipelined_broadcast_s(bytes, per_node, nvlink) + pipelined_broadcast_s(bytes, topology.nodes(), nic);
    }
    owned_comm.push_back(c);
  }
  const auto owned = overlapped_fwd_bwd(owned_units, owned_comm, hw, options.tokens_per_device, options.zero3);

  // Optimizer steps.
  const double adamw_shard = adamw_time_s((matrix_elements + elementwise_elements) / d, hw);
  const double elementwise_shard = adamw_time_s(elementwise_elements / d, hw);
  const double gather_grads = ring_all_gather_s(matrix_elements * elem_bytes, d, link);
  const double gather_update = muon_elementwise_time_s(matrix_elements / d, hw);
  double dmuon_slowest = 0;
  for (const auto& r : result.plan.per_rank) {
    const double owned_elements = static_cast<double>(r.bytes) / (3 * sizeof(float));
    dmuon_slowest = std::max(dmuon_slowest, r.time_s + muon_elementwise_time_s(owned_elements, hw));
  }

  auto finish = [&](double fwd_bwd_end, double opt_s, double opt_comm_s, double bytes) {
    StepBreakdown s;
    s.compute_s = compute;
    s.optimizer_s = opt_s;
    s.optimizer_comm_s = opt_comm_s;
    s.step_s = fwd_bwd_end + opt_s;
    s.exposed_comm_s = fwd_bwd_end - compute;
    s.bytes_per_device = bytes;
    return s;
  };
  const double gather_bytes = fsdp_bytes + matrix_elements * elem_bytes * (d - 1.0) / d;
  result.steps[Optimizer::adamw] = finish(even_end, adamw_shard, 0, fsdp_bytes);
  result.steps[Optimizer::muon_gather_plain] =
      finish(even_end, gather_grads + plain_ns + gather_update + elementwise_shard, gather_grads, gather_bytes);
  result.steps[Optimizer::muon_gather] =
      finish(even_end, gather_grads + engine_ns + gather_update + elementwise_shard, gather_grads, gather_bytes);
  result.steps[Optimizer::dmuon] = finish(owned.first, dmuon_slowest + elementwise_shard, 0, fsdp_bytes);
  return result;
}

}  // namespace dmuon::sim
