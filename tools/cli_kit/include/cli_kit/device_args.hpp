// --device cpu|cuda and --dtype for the subcommands that run Newton–Schulz (ns, bench ns, bench optimizer, tune):
// the backend comes from backend_for (CUDA device 0, or the rank's GPU under mpirun), the iterates' dtype
// defaults to bfloat16 on a GPU and on the CPU to cpu_ns_default_dtype (bfloat16 where it has bf16 matrix units, else float32;
// docs/ns.md, "Compute dtype") (DESIGN 6); `dmuon tune` says what its auto means on the CPU (each shape's faster).
#pragma once

#include <string>

#include "cli_kit/cli.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"

namespace dmuon::cli {

struct DeviceArgs {
  std::string device = "cpu";
  std::string dtype = "auto";

  // cpu_auto: what --dtype auto means on the CPU, for the help.
  void add_to(CLI::App* c, const std::string& cpu_auto = "bf16 with bf16 matrix units, else f32") {
    c->add_option("--device", device, "cpu | cuda (the backend that runs Newton-Schulz)")->capture_default_str();
    c->add_option("--dtype", dtype, "Newton-Schulz iterates: auto (cuda: bf16; cpu: " + cpu_auto + ") | f32 | bf16")
        ->capture_default_str();
  }
  DeviceKind kind() const { return parse_device_kind(device); }
  bool gpu() const { return kind() == DeviceKind::cuda; }
  Backend& backend(int index = 0) const { return backend_for(kind(), index); }
  DType iterates() const {
    if (dtype == "auto") return gpu() ? DType::bf16 : cpu_ns_default_dtype();
    if (dtype == "f32") return DType::f32;
    DMUON_CHECK(dtype == "bf16", "--dtype must be auto, f32 or bf16, got '", dtype, "'");
    return DType::bf16;
  }
};

}  // namespace dmuon::cli
