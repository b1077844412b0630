// Newton–Schulz speed on a device backend (DESIGN 2.5 on a GPU): per shape a `reference` row — the plain
// standard recurrence with full products, in bfloat16 as every public GPU Muon runs it — beside `standard`
// (symmetric products), `gram` (restarts [1, 3], as DESIGN 2.2 prescribes for half precision) and `auto`. Times
// are CUDA events around the queued work (time_queued), after warm-up, median of the repeats; useful TFLOP/s is the
// plain standard flop count over the time, against the backend's measured bf16 product peak. Standard C++ only
// (no CLI or JSON library): `dmuon bench ns --device cuda` and the GPU-only check tool both print it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/ns.hpp"

namespace dmuon {

struct DeviceNsPath {
  std::string path;  // reference | standard | gram | auto
  std::string algo;  // what it ran, e.g. "gram r[1,3] sym t4"
  double seconds_per_matrix = 0;
  double useful_gflops = 0;
  double fraction_of_peak = 0;
  double ratio_to_reference = 0;  // reference time / this time
};

struct DeviceNsShape {
  int64_t rows = 0, cols = 0;
  std::vector<DeviceNsPath> paths;  // those timed before an error
  std::string error;                // what this shape threw (the next shapes still run); empty: none
};

struct DeviceNsReport {
  std::string device;    // backend description
  std::string dtype;     // of the iterates
  double peak_gflops = 0;  // measured product rate (8192³ gemm, same dtype); 0 when it could not be measured
  std::string peak_error;  // why not (the shapes are timed all the same, their fraction_of_peak 0); empty: none
  int batch = 1, repeats = 0;
  std::vector<DeviceNsShape> shapes;
};

// The configuration of each path for `dtype` iterates.
NsOptions device_ns_path_options(const std::string& path, DType dtype);

// The product rate, in GFLOP/s, that a report's rows are compared to.
using ProductPeakFn = std::function<double(Backend& backend, DType dtype)>;

// Times every path on `batch` same-shape matrices of each shape (random Gaussian inputs, never zeros), after the
// product peak (`peak`; none: measure_product_gflops). An exception in the peak's probe is kept in `peak_error`, one
// in a shape in its `error`, and the shapes still run.
DeviceNsReport bench_ns_on_device(Backend& backend, const std::vector<std::pair<int64_t, int64_t>>& shapes, int batch,
                                  int repeats, DType dtype, const ProductPeakFn& peak = {});

// Seconds per call of `run` on `backend`: `warmup` untimed calls, then the median (statistics.hpp) of `repeats`
// timed ones.
double median_seconds_on(Backend& backend, int warmup, int repeats, const std::function<void()>& run);

// GFLOP/s of an n×n×n product with `dtype` operands and float32 accumulation (the peak the rows compare to).
double measure_product_gflops(Backend& backend, DType dtype, int64_t n = 8192, int repeats = 10);

std::string device_ns_json(const DeviceNsReport& report);
// s as a JSON string literal (quotes and backslashes escaped; the reports hold no control characters).
std::string json_string(const std::string& s);
std::string device_ns_table(const DeviceNsReport& report);
// One "FAIL bench ns RxC: error" line per shape that threw (empty when none did).
std::string device_ns_failures(const DeviceNsReport& report);

}  // namespace dmuon
