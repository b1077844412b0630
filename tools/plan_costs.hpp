// The --costs option of `dmuon plan`: where per-(shape, batch) NS times come from.
//   flops     flop counts on a device profile (--device), for hardware not present
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "dmuon/plan.hpp"

namespace dmuon::cli {

struct CostArgs {
  std::string source = "flops";
  std::string device = "h100-tf32";

  void add_to(CLI::App* c) {
    c->add_option("--costs", source, "Where NS times come from: flops (a device profile)")
        ->check(CLI::IsMember({"flops"}));
    c->add_option("--device", device, "Device profile for --costs flops")->check(CLI::IsMember(device_profile_names()));
  }

  BatchTimeFn batch_time(const std::vector<ParamSpec>&) const { return flop_batch_time(device_profile(device)); }

  std::string describe() const { return source == "flops" ? "flops on " + device : source; }
};

}  // namespace dmuon::cli
