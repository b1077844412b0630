// The `dmuon ns` command end to end: golden input in, orthogonalized output out; bad files give one
// clear line, a non-zero exit and no output file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>

#include "dmuon/atomic_file.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/npy.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

TEST(CliNs, OrthogonalizesAGoldenMatrix) {
  test::TempDir dir;
  for (const char* algo : {"standard", "gram", "auto"}) {
    const auto r = test::run_cli("ns --in " + test::data_path("ns_wide_in.npy") + " --out " + dir.file("o.npy") +
                                 " --dtype f32 --algo " + algo);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const NpyArray out = read_npy(dir.file("o.npy"));
    const NpyArray want = test::load_golden("ns_wide_out.npy");
    ASSERT_EQ(out.shape, want.shape);
    double err = 0, ref = 0;
    for (size_t i = 0; i < want.data.size(); ++i) {
      err += std::pow(out.data[i] - want.data[i], 2);
      ref += std::pow(want.data[i], 2);
    }
    // Same bound as ns_test's golden comparison: float32 rounding through 5 steps, ≤ 1e-4 relative.
    EXPECT_LT(std::sqrt(err / ref), 1e-4) << algo;
  }
}

// --dtype auto (the default) is cpu_ns_default_dtype: its output is --dtype f32's or bf16's bit for bit, the one the
// machine or DMUON_NS_DEFAULT_DTYPE picks (backend_conformance_test checks the rule with the machine faked); each
// forced value is followed whatever the machine.
TEST(CliNs, DefaultDtypeIsTheCpusDefault) {
  if (!cpu_backend().supports(DType::bf16)) GTEST_SKIP() << "no oneDNN: the CPU computes in float32 only";
  test::TempDir dir;
  const std::string ns = "ns --in " + test::data_path("ns_wide_in.npy") + " --out ";
  int runs = 0;
  const auto output_of = [&](const std::string& env, const std::string& dtype) {
    const std::string out = dir.file(std::to_string(runs++) + ".npy");
    const auto r = test::run_command(env + " " + DMUON_CLI_PATH + " " + ns + out + dtype);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return read_npy(out).data;
  };
  const auto f32 = output_of("env", " --dtype f32"), bf16 = output_of("env", " --dtype bf16");
  ASSERT_NE(f32, bf16);
  EXPECT_EQ(output_of("env", ""), cpu_ns_default_dtype() == DType::bf16 ? bf16 : f32);
  EXPECT_EQ(output_of("env DMUON_NS_DEFAULT_DTYPE=bf16", ""), bf16);
  EXPECT_EQ(output_of("env DMUON_NS_DEFAULT_DTYPE=f32", ""), f32);
}

void expect_refused(const std::string& bytes, const std::string& fragment) {
  test::TempDir dir;
  write_file_atomically(dir.file("in.npy"), bytes);
  const auto r = test::run_cli("ns --in " + dir.file("in.npy") + " --out " + dir.file("out.npy"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("dmuon: error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(fragment), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line: " << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.file("out.npy")));
}

TEST(CliNs, RefusesBadInputWithOneLineAndNoOutput) {
  const std::string good = read_file(test::data_path("ns_square_in.npy"));
  expect_refused(good.substr(0, good.size() - 10), "truncated");
  expect_refused("not a numpy file at all", "bad magic");
  test::TempDir dir;
  const std::vector<float> cube(8, 1.0f);
  write_npy(dir.file("cube.npy"), {2, 2, 2}, cube.data());
  expect_refused(read_file(dir.file("cube.npy")), "2-D");
  const std::vector<float> nan_matrix = {1.0f, NAN, 0.5f, 2.0f};
  write_npy(dir.file("nan.npy"), {2, 2}, nan_matrix.data());
  expect_refused(read_file(dir.file("nan.npy")), "non-finite");
}

}  // namespace
}  // namespace dmuon
