// Hardware profiles from models/hardware/*.json (include/dmuon/hardware_profile.hpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "dmuon/data_files.hpp"
#include "dmuon/error.hpp"
#include "dmuon/hardware_profile.hpp"
#include "io/json_file.hpp"

namespace dmuon {

namespace {
double positive_field(const nlohmann::json& j, const char* key, const std::string& path) {
  DMUON_CHECK(j.contains(key) && j.at(key).is_number(), path, ": hardware profile needs a number '", key, "'");
  const double v = j.at(key).get<double>();
  DMUON_CHECK(v > 0, path, ": '", key, "' must be positive, got ", v);
  return v;
}
double fraction_field(const nlohmann::json& j, const char* key, const std::string& path) {
  const double v = positive_field(j, key, path);
  DMUON_CHECK(v <= 1, path, ": '", key, "' is a fraction in (0, 1], got ", v);
  return v;
}
// A positive whole number of at most 2^31 - 1 (converting a larger double to int is undefined).
int count_field(const nlohmann::json& j, const char* key, const std::string& path) {
  const double v = positive_field(j, key, path);
  DMUON_CHECK(v == std::floor(v) && v <= std::numeric_limits<int>::max(), path, ": '", key,
              "' must be a whole number below 2^31, got ", v);
  return static_cast<int>(v);
}
// j[key] if it is a string, `fallback` if absent.
std::string text_field(const nlohmann::json& j, const char* key, const std::string& fallback, const std::string& path) {
  if (!j.contains(key)) return fallback;
  DMUON_CHECK(j.at(key).is_string(), path, ": '", key, "' must be a string");
  return j.at(key).get<std::string>();
}
}  // namespace

HardwareProfile load_hardware_profile(const std::string& name_or_path) {
  const std::string path = find_models_file("hardware", name_or_path, "hardware profile");
  const nlohmann::json j = read_json_file(path);
  DMUON_CHECK(j.is_object(), path, ": a hardware profile is a JSON object");
  HardwareProfile hw;
  hw.name = text_field(j, "name", name_or_path, path);
  hw.description = text_field(j, "description", "", path);
  hw.peak_flops = positive_field(j, "peak_flops", path);
  hw.mfu = fraction_field(j, "mfu", path);
  hw.ns_flops = positive_field(j, "ns_flops", path);
  hw.ns_efficiency = fraction_field(j, "ns_efficiency", path);
  hw.hbm_bytes_per_s = positive_field(j, "hbm_bytes_per_s", path);
  hw.intra_node_bytes_per_s = positive_field(j, "intra_node_bytes_per_s", path);
  hw.inter_node_bytes_per_s = positive_field(j, "inter_node_bytes_per_s", path);
  hw.intra_node_latency_s = positive_field(j, "intra_node_latency_s", path);
  hw.inter_node_latency_s = positive_field(j, "inter_node_latency_s", path);
  hw.kernel_launch_s = positive_field(j, "kernel_launch_s", path);
  hw.sm_count = count_field(j, "sm_count", path);
  hw.comm_bytes_per_element = positive_field(j, "comm_bytes_per_element", path);
  hw.syrk_speedup = positive_field(j, "syrk_speedup", path);
  hw.sym_gemm_speedup = positive_field(j, "sym_gemm_speedup", path);
  hw.ns_bytes_per_element = positive_field(j, "ns_bytes_per_element", path);
  DMUON_CHECK(j.contains("batched_kernels") && j.at("batched_kernels").is_boolean(), path,
              ": hardware profile needs a boolean 'batched_kernels' (profiles from before the fixed-cost model: "
              "re-run `dmuon bench calibrate`)");
  hw.batched_kernels = j.at("batched_kernels").get<bool>();
  // Optional: absent means devices with their own hardware.
  if (j.contains("shared_cores")) {
    hw.shared_cores = count_field(j, "shared_cores", path);
    hw.calibration_ranks = count_field(j, "calibration_ranks", path);
    hw.single_rank_speedup = positive_field(j, "single_rank_speedup", path);
    hw.single_rank_ns_speedup = positive_field(j, "single_rank_ns_speedup", path);
  }
  DMUON_CHECK(j.contains("sources") && j.at("sources").is_object(), path,
              ": a hardware profile cites its numbers in a 'sources' object");
  for (const auto& [key, value] : j.at("sources").items()) {
    DMUON_CHECK(value.is_string(), path, ": source of '", key, "' must be a string (a citation)");
    hw.sources[key] = value.get<std::string>();
  }
  return hw;
}

}  // namespace dmuon
