// bench/device_ns_bench.cpp (what `bench ns --device cuda` and dmuon_gpu_check's `bench ns` print) on the CPU backend:
// a product peak that cannot be measured costs the report its peak only, never its shapes.
#include <gtest/gtest.h>

#include <stdexcept>

#include "device_ns_bench.hpp"
#include "dmuon/backend.hpp"

namespace dmuon {
namespace {

TEST(DeviceNsBench, APeakThatThrowsLeavesEveryShapeTimedAndSaysWhy) {
  const auto failing_peak = [](Backend&, DType) -> double {
    throw std::runtime_error("fake: the product peak ran out of memory");
  };
  const DeviceNsReport report = bench_ns_on_device(cpu_backend(), {{8, 16}, {16, 8}}, 2, 1, DType::f32, failing_peak);
  EXPECT_EQ(report.peak_error, "fake: the product peak ran out of memory");
  ASSERT_EQ(report.shapes.size(), 2u);
  for (const DeviceNsShape& shape : report.shapes) {
    EXPECT_EQ(shape.error, "") << shape.rows << "x" << shape.cols;
    ASSERT_EQ(shape.paths.size(), 4u);
    for (const DeviceNsPath& p : shape.paths) {
      EXPECT_GT(p.seconds_per_matrix, 0) << p.path;
      EXPECT_EQ(p.fraction_of_peak, 0) << p.path;  // no peak to compare to, and no division by zero
    }
  }
  const std::string json = device_ns_json(report);
  EXPECT_NE(json.find("\"peak_error\": \"fake: the product peak ran out of memory\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"rows\": 16, \"cols\": 8, \"paths\": [{"), std::string::npos) << json;
  EXPECT_EQ(device_ns_failures(report), "FAIL bench ns product peak: fake: the product peak ran out of memory\n");
  EXPECT_NE(device_ns_table(report).find("product peak FAIL: fake"), std::string::npos);
}

}  // namespace
}  // namespace dmuon
