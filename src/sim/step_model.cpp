// One training step on the simulated cluster: a compute stream and a communication stream per
// device, events placed in the order a sharded training loop issues them (see sim.hpp).
#include <algorithm>
#include <map>

#include "dmuon/error.hpp"
#include "dmuon/sim.hpp"
#include "io/enum_names.hpp"

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

// Elements each of `devices` ranks holds of a unit: in the owner-aligned layout its owned matrices and
// an even share of the elementwise parameters; in the even layout (`owned` false) an even share of all.
std::vector<double> unit_blocks(const UnitShape& u, int devices, bool owned) {
  if (!owned) return std::vector<double>(devices, u.params / devices);
  std::vector<double> blocks(devices, u.elementwise / devices);
  for (const auto& [rank, elements] : u.owned_matrix_elements) blocks[rank] += elements;
  return blocks;
}

// The single communication stream: operations run one at a time in issue order.
class CommStream {
 public:
  double run(double ready_s, double duration_s) {
    const double start = std::max(ready_s, free_at_);
    free_at_ = start + duration_s;
    return free_at_;
  }

 private:
  double free_at_ = 0;
};

struct UnitComm {
  double gather_s = 0;
  double reduce_s = 0;
};

// Per unit, the all-gatherv of its weights and the reduce-scatterv of its gradients, for either layout.
// Even layout (FSDP): a ring all-gather over the world and a two-stage reduce-scatter. Owner-aligned layout
// (DMuon): blocks are uneven, and the cheaper of two algorithms runs:
//  - the same ring / two-stage collectives, every step paced by the largest block;
//  - the elementwise part by those collectives, and the owners' matrices by (gather) one group of concurrent
//    chain-pipelined broadcasts, (p−1)·α + Σ owned bytes/β, as every rank receives every block once, and
//    (reduce) per owner a two-stage reduce-scatter of its block followed by a chain gather of the pieces to
//    the owner within its node.
// Either costs at least the even layout's collectives: the largest block is at least the mean block, and
// the second pays the ring's p−1 latencies and every byte at least once.
std::vector<UnitComm> unit_comm(const std::vector<UnitShape>& units, bool owned, const HardwareProfile& hw,
                                const Cluster& cluster) {
  const Link link = world_link(hw, cluster);
  const Link nvlink{hw.intra_node_bytes_per_s, hw.intra_node_latency_s};
  const int d = cluster.devices, per_node = std::min(d, cluster.devices_per_node);
  const double bpe = hw.comm_bytes_per_element;
  std::vector<UnitComm> out;
  for (const auto& u : units) {
    std::vector<double> bytes = unit_blocks(u, d, owned);
    for (double& b : bytes) b *= bpe;
    UnitComm c{ring_all_gatherv_s(*std::max_element(bytes.begin(), bytes.end()), d, link),
               two_stage_reduce_scatterv_s(bytes, hw, cluster)};
    if (owned && d > 1) {
      double owned_bytes = 0;
      double reduce = two_stage_reduce_scatter_s(u.elementwise * bpe, hw, cluster);
      for (const auto& [rank, elements] : u.owned_matrix_elements) {
        owned_bytes += elements * bpe;
        reduce += two_stage_reduce_scatter_s(elements * bpe, hw, cluster) +
                  pipelined_broadcast_s(elements * bpe, per_node, nvlink);
      }
      const double gather = ring_all_gather_s(u.elementwise * bpe, d, link) + pipelined_broadcast_s(owned_bytes, d, link);
      c.gather_s = std::min(c.gather_s, gather);
      c.reduce_s = std::min(c.reduce_s, reduce);
    }
    out.push_back(c);
  }
  return out;
}

// Forward gathers, backward (re-gathers under Z3 and) reduce-scatters, overlapped with compute.
// `fwd[i]`: unit i's forward seconds; backward takes twice that. Returns the end of backward and of the
// last reduce-scatter.
double overlapped_fwd_bwd(const std::vector<double>& fwd, const std::vector<UnitComm>& comm, bool zero3) {
  const size_t n = fwd.size();
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
    compute_free = start + 2 * fwd[k];
    last_reduce = stream.run(compute_free, comm[k].reduce_s);
  }
  return std::max(compute_free, last_reduce);
}

// Memory-bound optimizer work: `streams` float32 arrays of `elements` read or written, in one kernel
// (a multi-tensor kernel over every parameter it touches). Optimizer state is float32 on every device.
struct Elementwise {
  double seconds = 0;
  double launch_s = 0;
};
Elementwise elementwise(double elements, int streams, const HardwareProfile& hw) {
  return {elements * streams * 4 / hw.hbm_bytes_per_s + hw.kernel_launch_s, hw.kernel_launch_s};
}
Elementwise operator+(Elementwise a, Elementwise b) { return {a.seconds + b.seconds, a.launch_s + b.launch_s}; }
// The passes of each update (src/optim/update_rules.cpp): the gradient-norm read (1 stream); AdamW reads
// p, g, m, v and writes p, m, v (7); Muon's momentum reads g, m and writes m, u (4); its weight update
// reads w, o and writes w (3).
Elementwise grad_norm(double elements, const HardwareProfile& hw) { return elementwise(elements, 1, hw); }
Elementwise adamw(double elements, const HardwareProfile& hw) { return elementwise(elements, 7, hw); }
Elementwise muon_momentum_and_apply(double elements, const HardwareProfile& hw) {
  return elementwise(elements, 4, hw) + elementwise(elements, 3, hw);
}

}  // namespace

namespace {
constexpr EnumName<ComparedOptimizer> kOptimizerNames[] = {{ComparedOptimizer::adamw, "adamw"},
                                                           {ComparedOptimizer::muon_gather_plain, "muon-gather-plain"},
                                                           {ComparedOptimizer::muon_gather, "muon-gather"},
                                                           {ComparedOptimizer::dmuon, "dmuon"}};
}  // namespace

std::string to_string(ComparedOptimizer o) { return std::string(name_of(kOptimizerNames, o)); }

const std::vector<ComparedOptimizer>& compared_optimizers() {
  static const std::vector<ComparedOptimizer> all = [] {
    std::vector<ComparedOptimizer> out;
    for (const auto& entry : kOptimizerNames) out.push_back(entry.value);
    return out;
  }();
  return all;
}

SimResult simulate_step(const std::vector<ParamSpec>& params, const HardwareProfile& profile,
                        const Cluster& cluster, const SimOptions& options) {
  DMUON_CHECK(!params.empty(), "simulate_step: the model has no parameters");
  DMUON_CHECK(options.tokens_per_device > 0, "tokens per device must be positive, got ", options.tokens_per_device);
  const int d = cluster.devices;
  const HardwareProfile hw = at_devices(profile, d);
  const Link link = world_link(hw, cluster);
  const double elem_bytes = hw.comm_bytes_per_element;

  SimResult result;
  result.devices = d;
  result.device = hw;
  const BatchTimeFn dmuon_batch_time = [&hw](int64_t rows, int64_t cols, int batch) {
    return ns_time_s(rows, cols, batch, NsEngine::dmuon, hw);
  };
  DMUON_CHECK(options.ns_blocks.empty() || options.ns_blocks.size() == params.size(), "simulate_step: ",
              options.ns_blocks.size(), " parameters' Newton–Schulz blocks for ", params.size(), " parameters");
  std::vector<PlanItem> items = make_plan_items(params, d, dmuon_batch_time, options.ns_blocks);
  if (options.mesh) lay_out_on_mesh(items, params, *options.mesh, d);
  result.plan = make_plan(params, items, d, options.plan);

  // Totals over the model; NS of every matrix (a split one: its blocks) on one device (what gather-then-compute
  // runs on each).
  double matrix_elements = 0, elementwise_elements = 0;
  NsCost plain_ns, engine_ns;
  std::map<std::pair<int64_t, int64_t>, int> shape_count;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (p.role == ParamRole::matrix) {
      matrix_elements += static_cast<double>(p.numel());
      if (!options.ns_blocks.empty() && options.ns_blocks[i].size() > 1) {
        for (const MatrixBlock& b : options.ns_blocks[i]) ++shape_count[{b.rows, b.cols}];
      } else {
        ++shape_count[{p.rows(), p.cols()}];
      }
    } else {
      elementwise_elements += static_cast<double>(p.numel());
    }
  }
  for (const auto& [shape, count] : shape_count) {
    const NsCost plain = ns_cost(shape.first, shape.second, count, NsEngine::plain, hw);
    const NsCost engine = ns_cost(shape.first, shape.second, count, NsEngine::dmuon, hw);
    plain_ns.total_s += plain.total_s;
    plain_ns.launch_s += plain.launch_s;
    engine_ns.total_s += engine.total_s;
    engine_ns.launch_s += engine.launch_s;
  }

  // Forward and backward: FSDP's even layout (AdamW and both gather-then-compute baselines) and DMuon's
  // owner-aligned one, with the same compute.
  const std::vector<int> no_owner(params.size(), 0);
  const std::vector<UnitShape> even_units = unit_shapes(params, no_owner);
  const std::vector<UnitShape> owned_units = unit_shapes(params, result.plan.owner);
  DMUON_CHECK(options.unit_forward_flops.empty() || options.unit_forward_flops.size() == even_units.size(),
              "simulate_step: ", options.unit_forward_flops.size(), " forward flop counts for ", even_units.size(),
              " units");
  const double rate = hw.peak_flops * hw.mfu;
  std::vector<double> fwd;
  double compute = 0;
  for (size_t i = 0; i < even_units.size(); ++i) {
    const double flops = options.unit_forward_flops.empty() ? 2 * even_units[i].params * options.tokens_per_device
                                                            : options.unit_forward_flops[i];
    fwd.push_back(flops / rate);
    compute += 3 * fwd.back();
  }
  const double even_end = overlapped_fwd_bwd(fwd, unit_comm(even_units, false, hw, cluster), options.zero3);
  const double owned_end = overlapped_fwd_bwd(fwd, unit_comm(owned_units, true, hw, cluster), options.zero3);
  double unit_bytes_total = 0;
  for (const auto& u : even_units) unit_bytes_total += u.params * elem_bytes;
  const double fsdp_bytes = unit_bytes_total * (d - 1.0) / d * (options.zero3 ? 3 : 2);

  // Optimizer steps. Every optimizer reads its local gradients for the global norm and all-reduces the sum.
  const double norm_reduce = tree_all_reduce_s(2 * sizeof(double), d, link);
  const double local_elements = (matrix_elements + elementwise_elements) / d;
  const Elementwise elementwise_shard = grad_norm(local_elements, hw) + adamw(elementwise_elements / d, hw);
  // Gather-then-compute: momentum on its even pieces, all-gather of every Muon matrix, reassembly (a copy
  // of every matrix), NS on all of them, weight update on its pieces.
  const double gather_grads = ring_all_gather_s(matrix_elements * elem_bytes, d, link);
  const Elementwise gather_elementwise = elementwise_shard + muon_momentum_and_apply(matrix_elements / d, hw) +
                                         (d > 1 ? elementwise(matrix_elements, 2, hw) : Elementwise{});
  // DMuon: the slowest rank's planned NS plus the updates of the matrices it owns.
  double dmuon_slowest = -1, dmuon_ns = 0, dmuon_ns_launches = 0;
  Elementwise dmuon_elementwise = elementwise_shard;
  for (const auto& r : result.plan.per_rank) {
    const double owned_elements = static_cast<double>(r.bytes) / (3 * sizeof(float));
    const Elementwise e = elementwise_shard + muon_momentum_and_apply(owned_elements, hw);
    if (r.time_s + e.seconds <= dmuon_slowest) continue;
    dmuon_slowest = r.time_s + e.seconds;
    dmuon_elementwise = e;
    dmuon_ns = r.time_s;
    dmuon_ns_launches = 0;  // the launches inside its planned time (batches as the plan runs them)
    for (const auto& b : r.batches)
      dmuon_ns_launches += ns_cost(b.rows, b.cols, static_cast<int>(b.params.size()), NsEngine::dmuon, hw).launch_s;
  }

  auto finish = [&](double fwd_bwd_end, double ns, double launches_in_ns, Elementwise e, double comm_s,
                    double bytes) {
    StepBreakdown s;
    s.compute_s = compute;
    s.optimizer_ns_s = ns;
    s.optimizer_elementwise_s = e.seconds;
    s.optimizer_launch_s = launches_in_ns + e.launch_s;
    s.optimizer_comm_s = comm_s + norm_reduce;
    s.optimizer_s = ns + e.seconds + s.optimizer_comm_s;
    s.step_s = fwd_bwd_end + s.optimizer_s;
    s.exposed_comm_s = fwd_bwd_end - compute;
    s.bytes_per_device = bytes;
    return s;
  };
  const double gather_bytes = fsdp_bytes + matrix_elements * elem_bytes * (d - 1.0) / d;
  result.steps[ComparedOptimizer::adamw] =
      finish(even_end, 0, 0, grad_norm(local_elements, hw) + adamw(local_elements, hw), 0, fsdp_bytes);
  result.steps[ComparedOptimizer::muon_gather_plain] =
      finish(even_end, plain_ns.total_s, plain_ns.launch_s, gather_elementwise, gather_grads, gather_bytes);
  result.steps[ComparedOptimizer::muon_gather] =
      finish(even_end, engine_ns.total_s, engine_ns.launch_s, gather_elementwise, gather_grads, gather_bytes);
  result.steps[ComparedOptimizer::dmuon] =
      finish(owned_end, dmuon_ns, dmuon_ns_launches, dmuon_elementwise, 0, fsdp_bytes);
  for (ComparedOptimizer o : compared_optimizers())
    result.memory[o] = rank_memory(params, result.plan.owner, d, o, hw, options.ns_blocks);
  return result;
}

}  // namespace dmuon::sim
