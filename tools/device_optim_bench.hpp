// One optimizer step on a model's shapes with parameters, gradients and optimizer state in a device backend's
// memory (the single-GPU half of `dmuon bench optimizer --device cuda`): AdamW, and Muon with Newton–Schulz in
// the device's iterate dtype. Seeded Gaussian parameters and gradients, one untimed warm-up step, then the
// median of `steps` steps timed on the device (time_on: CUDA events around step()).
#pragma once

#include <string>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/params.hpp"

namespace dmuon {

struct DeviceStepResult {
  std::string optimizer;  // adamw | muon
  std::vector<double> step_s;
  double step_s_median = 0;
  double ns_s = 0;  // Newton–Schulz in the last step (Optimizer::Stats)
  double weight_norm = 0;  // ‖all parameters‖ after the steps, to compare runs
};

// `optimizers`: names among "adamw", "muon".
std::vector<DeviceStepResult> bench_optimizer_on_device(Backend& backend, const std::vector<ParamSpec>& params,
                                                        const std::vector<std::string>& optimizers, int steps,
                                                        DType ns_dtype);

}  // namespace dmuon
