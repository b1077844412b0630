// The --costs option of `dmuon plan`: where per-(shape, batch) NS times come from.
//   measured  this machine's tuned times (dmuon tune's cache; what is missing is tuned first)
//   flops     flop counts at a hardware profile's NS rate (--device), for hardware not present
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "dmuon/plan.hpp"
#include "tune_session.hpp"

namespace dmuon::cli {

struct CostArgs {
  std::string source = "flops";
  std::string device = "h200";
  TuneSessionArgs tuning;

  void add_to(CLI::App* c) {
    c->add_option("--costs", source, "Where NS times come from: measured (tuned here) or flops (--device)")
        ->capture_default_str()
        ->check(CLI::IsMember({"measured", "flops"}));
    c->add_option("--device", device, "Hardware profile for --costs flops: a800, h200, or a path (models/hardware/*.json)")
        ->capture_default_str();
    tuning.add_to(c);
  }

  // ns_blocks: as make_plan_items takes them (a split matrix's block shapes are tuned in its place).
  BatchTimeFn batch_time(const std::vector<ParamSpec>& params, int ranks,
                         const std::vector<std::vector<MatrixBlock>>& ns_blocks = {}) const {
    if (source == "flops") return flop_batch_time(load_hardware_profile(device));
    return tuned_batch_time(tuning.tune(tune_requests(params, ranks, ns_blocks)));
  }

  std::string describe() const {
    if (source == "flops") return "flops on " + device;
    const std::string cache = tuning.cache_path();
    return "measured, " + std::to_string(tuning.resolved_threads()) + " threads (" + (cache.empty() ? "no cache" : cache) +
           ")";
  }
};

}  // namespace dmuon::cli
