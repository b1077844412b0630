// --device cpu|cuda and --dtype for the subcommands that run Newton–Schulz (ns, bench ns, bench optimizer, tune):
// the backend comes from backend_for (CUDA device 0, or the rank's GPU under mpirun), the iterates' dtype
// defaults to bfloat16 on a GPU and to float32 on the CPU, whose bfloat16 path (oneDNN) is asked for with --dtype bf16
// (docs/ns.md, "Compute dtype") (DESIGN 6).
#pragma once

#include <string>

#include "cli_kit/cli.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"

namespace dmuon::cli {

struct DeviceArgs {
  std::string device = "cpu";
  std::string dtype = "auto";

  void add_to(CLI::App* c) {
    c->add_option("--device", device, "cpu | cuda (the backend that runs Newton-Schulz)")->capture_default_str();
    c->add_option("--dtype", dtype, "Newton-Schulz iterates: auto (cuda: bf16; cpu: f32) | f32 | bf16 (cpu: through oneDNN)")
        ->capture_default_str();
  }
  DeviceKind kind() const { return parse_device_kind(device); }
  bool gpu() const { return kind() == DeviceKind::cuda; }
  Backend& backend(int index = 0) const { return backend_for(kind(), index); }
  DType iterates() const {
    if (dtype == "auto") return gpu() ? DType::bf16 : DType::f32;
    if (dtype == "f32") return DType::f32;
    DMUON_CHECK(dtype == "bf16", "--dtype must be auto, f32 or bf16, got '", dtype, "'");
    return DType::bf16;
  }
};

}  // namespace dmuon::cli
