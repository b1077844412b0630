// The `dmuon ns` command end to end: golden input in, orthogonalized output out; bad files give one
// clear line, a non-zero exit and no output file. `dmuon tune`'s compute dtype per shape as its table shows it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <regex>
#include <string>
#include <tuple>
#include <utility>

#include "dmuon/atomic_file.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/npy.hpp"
#include "dmuon/tune.hpp"
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

// OpenBLAS's generic kernels on a CPU with AVX-512 (what it runs on a model it does not know, forced here) get one
// warning after a computing command, naming the fix; its SkylakeX kernels get none. A CPU without AVX-512 gets none.
TEST(CliNs, WarnsWhenOpenBlasRunsKernelsBelowTheCpus) {
  test::TempDir dir;
  const std::string ns = std::string(DMUON_CLI_PATH) + " ns --dtype f32 --in " + test::data_path("ns_wide_in.npy") +
                         " --out " + dir.file("o.npy");
  const auto generic = test::run_command("env OPENBLAS_CORETYPE=Prescott " + ns);
  ASSERT_EQ(generic.exit_code, 0) << generic.output;
  const std::string warning = "dmuon: warning: OpenBLAS runs its Prescott kernels on this CPU, which has AVX-512";
  if (!linalg::cpu_has_avx512()) {
    EXPECT_EQ(generic.output.find("dmuon: warning: OpenBLAS"), std::string::npos) << generic.output;
    return;
  }
  EXPECT_EQ(std::count(generic.output.begin(), generic.output.end(), '\n'), 1) << generic.output;
  EXPECT_EQ(generic.output.rfind(warning, 0), 0u) << generic.output;
  EXPECT_NE(generic.output.find("start the process with OPENBLAS_CORETYPE=SkylakeX"), std::string::npos);
  const auto native = test::run_command("env OPENBLAS_CORETYPE=SkylakeX " + ns);
  ASSERT_EQ(native.exit_code, 0) << native.output;
  EXPECT_EQ(native.output, "") << native.output;
}

// `dmuon tune --dtype auto` (the default) shows each shape's compute dtype: with bf16 matrix units (forced here, so on any
// CPU) the one its cache entry chose among bf16 and float32, in the table's dtype column and in one line naming the
// shapes of each; with none (float32 forced) float32 for every shape and no such line, tuned in float32 alone.
TEST(CliTune, ShowsEachShapesChosenDtype) {
  test::TempDir dir;
  write_file_atomically(dir.file("tiny.json"), R"({"name": "tiny", "description": "test model",
    "sources": {"config": "made up for tests"},
    "components": [{"config": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
      "tie_word_embeddings": true}}]})");
  // The model's requests at D = 1: q, o 64x64 (batch 2); k, v 32x64 (2); gate, up 128x64 (2); down 64x128 (1).
  TuneKey key = current_tune_key(1);
  key.dtype = tune_dtype_key({DType::bf16, DType::f32});
  TuneCache cache(key);
  for (const auto& [rows, cols, batch, dtype] : {std::tuple{32, 64, 2, DType::f32}, std::tuple{64, 64, 2, DType::bf16},
                                                 std::tuple{64, 128, 1, DType::bf16}, std::tuple{128, 64, 2, DType::f32}}) {
    TuneEntry e{rows, cols, batch, untuned_options(1, dtype), 1e-3, 2e-3, {}};
    e.dtype_seconds = {{DType::f32, 1e-3}, {DType::bf16, 1e-3}};
    e.dtype_seconds[dtype == DType::f32 ? DType::bf16 : DType::f32] = 3e-3;
    cache.put(e);
  }
  cache.save(dir.file("tune.json"));
  const std::string tune = std::string(" ") + DMUON_CLI_PATH + " tune --threads 1 --progress plain --model " +
                           dir.file("tiny.json") + " --tune-cache " + dir.file("tune.json");
  const auto chosen = test::run_command("env DMUON_NS_DEFAULT_DTYPE=bf16" + tune);
  ASSERT_EQ(chosen.exit_code, 0) << chosen.output;
  EXPECT_NE(chosen.output.find("(cached)"), std::string::npos) << chosen.output;
  EXPECT_EQ(chosen.output.find("timings"), std::string::npos) << "timed: " << chosen.output;
  const auto row = [](const std::string& shape, const std::string& dtype) {
    return std::regex("\n" + shape + R"( +\d+  [^\n]*  )" + dtype + " ");
  };
  for (const auto& [shape, dtype] : {std::pair{"32x64", "float32"}, std::pair{"64x64", "bfloat16"},
                                     std::pair{"64x128", "bfloat16"}, std::pair{"128x64", "float32"}})
    EXPECT_TRUE(std::regex_search(chosen.output, row(shape, dtype))) << shape << " " << dtype << "\n" << chosen.output;
  EXPECT_NE(chosen.output.find("compute dtype chosen by measurement among bfloat16, float32: bfloat16 for 64x64 b2 "
                               "(float32 3.00x slower), 64x128 b1 (float32 3.00x slower); float32 for 32x64 b2 "
                               "(bfloat16 3.00x slower), 128x64 b2 (bfloat16 3.00x slower)\n"),
            std::string::npos)
      << chosen.output;

  const auto float32 = test::run_command("env DMUON_NS_DEFAULT_DTYPE=f32" + tune);
  ASSERT_EQ(float32.exit_code, 0) << float32.output;
  for (const char* shape : {"32x64", "64x64", "64x128", "128x64"})
    EXPECT_TRUE(std::regex_search(float32.output, row(shape, "float32"))) << shape << "\n" << float32.output;
  EXPECT_EQ(float32.output.find("  bfloat16 "), std::string::npos) << float32.output;
  // The chosen entries are another setting's: float32 alone is keyed (and timed) as an explicit float32 caller.
  EXPECT_NE(float32.output.find("dtype 'bfloat16 or float32' there, 'float32' here"), std::string::npos)
      << float32.output;
  EXPECT_EQ(float32.output.find("chosen by measurement"), std::string::npos) << float32.output;
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
