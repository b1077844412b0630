// Every numeric option of the dmuon CLI rejects an out-of-range value before doing any work: the
// command exits non-zero and its first line names the flag and the value (CLI11's checks print
// "--flag: must ..., got V" and CLI11's "Run with --help" hint; the tool's own checks print one
// "dmuon: error: --flag: ..." line).
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "test_data.hpp"

namespace dmuon {
namespace {

struct BadValue {
  std::string args;        // after `dmuon`
  std::string first_line;  // how the first line of output starts (dmuon::Error appends [file:line])
};

// The lines of `text`, without their '\n'.
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

void expect_rejected(const BadValue& b) {
  SCOPED_TRACE("dmuon " + b.args);
  // `timeout`: a command that starts working instead of failing ends as exit code 124, not a stuck test.
  const test::CommandResult r = test::run_command("timeout 60 " + std::string(DMUON_CLI_PATH) + " " + b.args);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "timed out: " << r.output;
  const std::vector<std::string> lines = lines_of(r.output);
  ASSERT_FALSE(lines.empty());
  // Every error is one line "dmuon: error: <what>"; first_line may spell the prefix or not.
  const std::string prefix = "dmuon: error: ";
  const std::string want = b.first_line.rfind(prefix, 0) == 0 ? b.first_line : prefix + b.first_line;
  EXPECT_EQ(lines[0].rfind(want, 0), 0u) << r.output;
  EXPECT_EQ(lines.size(), 1u) << "one line: " << r.output;
}

TEST(CliOptions, TrainRejectsOutOfRangeNumbersNamingTheFlag) {
  for (const BadValue& b : std::vector<BadValue>{
           {"train --threads -3", "--threads: must be between 0 and 1024, got -3"},
           {"train --weight-decay -5", "--weight-decay: must be at least 0, got -5"},
           {"train --weight-decay nan", "--weight-decay: must be a finite number, got nan"},
           {"train --lr inf", "--lr: must be a finite number, got inf"},
           {"train --adamw-lr 0", "--adamw-lr: must be greater than 0, got 0"},
           {"train --steps 0", "--steps: must be at least 1, got 0"},
           {"train --steps 99999999999999999999", "--steps: out of range, got 99999999999999999999"},
           {"train --seed -1", "--seed: expected a non-negative integer, got '-1'"},
           {"train --layers 0", "--layers: must be at least 1, got 0"},
           {"train --width -32", "--width: must be at least 1, got -32"},
           {"train --heads 0", "--heads: must be at least 1, got 0"},
           {"train --context 0", "--context: must be at least 1, got 0"},
           {"train --batch 0", "--batch: must be at least 1, got 0"},
           {"train --micro-batches 0", "--micro-batches: must be at least 1, got 0"},
           {"train --warmup -1", "--warmup: must be at least 0, got -1"},
           {"train --min-lr-ratio 1.5", "--min-lr-ratio: must be between 0 and 1, got 1.5"},
           {"train --val-every -1", "--val-every: must be at least 0, got -1"},
           {"train --val-batches 0", "--val-batches: must be at least 1, got 0"},
       })
    expect_rejected(b);
}

TEST(CliOptions, NsAndBenchmarksRejectOutOfRangeNumbersNamingTheFlag) {
  for (const BadValue& b : std::vector<BadValue>{
           {"ns --in a.npy --out b.npy --threads -4", "--threads: must be between 0 and 1024, got -4"},
           {"ns --in a.npy --out b.npy --tiles 0", "--tiles: must be at least 1, got 0"},
           {"ns --in a.npy --out b.npy --steps -1", "--steps: must be at least 0, got -1"},
           {"ns --in a.npy --out b.npy --safety -1", "--safety: must be at least 0, got -1"},
           {"bench ns --threads 5000", "--threads: must be between 0 and 1024, got 5000"},
           {"bench ns --batch 0", "--batch: must be at least 1, got 0"},
           {"bench ns --repeats 0", "--repeats: must be at least 1, got 0"},
           {"bench gpt --layers 0", "--layers: must be at least 1, got 0"},
           {"bench gpt --batch -2", "--batch: must be at least 1, got -2"},
           {"bench gpt --repeats 0", "--repeats: must be at least 1, got 0"},
           {"bench gpt --threads -1", "--threads: must be between 0 and 1024, got -1"},
           {"bench gpt --width 32 --heads 3",
            "dmuon: error: --width 32 is not divisible by --heads 3"},
           {"bench comm --iters 0", "--iters: must be at least 1, got 0"},
           {"bench comm --bytes 1e30G", "dmuon: error: --bytes: '1e30G' is larger than 64G, the largest size"},
           {"bench comm --bytes 1K,inf", "dmuon: error: --bytes: 'inf' is larger than 64G, the largest size"},
           {"bench comm --bytes 2", "dmuon: error: --bytes: '2' is less than one float32 (4 bytes)"},
       })
    expect_rejected(b);
}

TEST(CliOptions, PlanTuneAndSimulateRejectOutOfRangeNumbersNamingTheFlag) {
  for (const BadValue& b : std::vector<BadValue>{
           {"plan --model gpt2 --ranks 0", "--ranks: must be at least 1, got 0"},
           {"plan --model gpt2 --ranks 2 --time-limit 0", "--time-limit: must be greater than 0, got 0"},
           {"plan --model gpt2 --ranks 2 --memory-slack -0.5", "--memory-slack: must be at least 0, got -0.5"},
           {"plan --model gpt2 --ranks 2 --layers -1", "--layers: must be at least 0, got -1"},
           {"plan --model gpt2 --ranks 2 --costs measured --rounds 0", "--rounds: must be at least 1, got 0"},
           {"tune --model gpt2 --layers 1 --ranks 0", "--ranks: must be at least 1, got 0"},
           {"tune --model gpt2 --layers 1 --threads -2", "--threads: must be between 0 and 1024, got -2"},
           {"simulate --model gpt2 --devices 8,0", "--devices: must be at least 1, got 0"},
           {"simulate --model gpt2 --gpus-per-node 0", "--gpus-per-node: must be at least 1, got 0"},
           {"simulate --model gpt2 --tokens-per-device 0", "--tokens-per-device: must be greater than 0, got 0"},
           {"simulate --model gpt2 --layers -2", "--layers: must be at least 0, got -2"},
       })
    expect_rejected(b);
}

TEST(CliOptions, PlanAndSimulateRejectABadMeshNamingIt) {
  for (const BadValue& b : std::vector<BadValue>{
           {"plan --model gpt2 --mesh 1x2x2", "--mesh: mesh '1x2x2' has 3 sizes; it needs four, dp_replicate x "
                                               "dp_shard x tp x ep"},
           {"plan --model gpt2 --mesh 1x0x2x1", "--mesh: mesh '1x0x2x1': dp_shard must be at least 1, got 0"},
           {"plan --model gpt2 --mesh 1x2xtwox1", "--mesh: mesh '1x2xtwox1': tp 'two' is not a whole number"},
           {"plan --model gpt2 --mesh 1x2x2x1 --ranks 8", "--mesh 1x2x2x1 has 4 ranks but --ranks is 8"},
           {"plan --model gpt2", "give --ranks or --mesh"},
           {"simulate --model gpt2 --mesh 2x2x2x0", "--mesh: mesh '2x2x2x0': ep must be at least 1, got 0"},
           {"simulate --model gpt2 --mesh 1x2x1x1 --devices 2", "--devices excludes --mesh"},
       })
    expect_rejected(b);
}

// Numbers are decimal: CLI11 alone would read "010" as octal 8.
TEST(CliOptions, LeadingZerosAreDecimal) {
  const test::CommandResult r =
      test::run_command("timeout 60 " + std::string(DMUON_CLI_PATH) + " plan --model gpt2 --ranks 010 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"ranks\": 10"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace dmuon
