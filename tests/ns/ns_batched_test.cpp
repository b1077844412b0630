// newton_schulz_batched equals k calls of newton_schulz bit for bit, in both batch modes, and
// reports a bad matrix by its name.
#include <gtest/gtest.h>

#include <limits>

#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/ns.hpp"
#include "ns_reference.hpp"

namespace dmuon {
namespace {

struct Batch {
  std::vector<std::vector<float>> in, out;
  std::vector<const float*> in_ptrs;
  std::vector<float*> out_ptrs;
  Batch(int k, int64_t rows, int64_t cols) {
    for (int i = 0; i < k; ++i) {
      in.push_back(test::to_floats(test::gaussian(rows, cols, 100 + i)));
      out.emplace_back(rows * cols, -1.0f);
    }
    for (int i = 0; i < k; ++i) {
      in_ptrs.push_back(in[i].data());
      out_ptrs.push_back(out[i].data());
    }
  }
};

TEST(NewtonSchulzBatched, EqualsUnbatchedBitForBit) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{40, 100}, {100, 40}, {60, 60}, {1, 30}}) {
    for (NsBatchMode mode : {NsBatchMode::sequential, NsBatchMode::concurrent}) {
      for (int threads : {1, 2, 3}) {
        NsOptions options;
        options.batch_mode = mode;
        options.threads = threads;
        Batch batch(5, rows, cols);
        newton_schulz_batched(batch.in_ptrs, batch.out_ptrs, rows, cols, options);
        for (int i = 0; i < 5; ++i) {
          std::vector<float> single(rows * cols);
          newton_schulz(batch.in[i].data(), single.data(), rows, cols, NsOptions{});
          EXPECT_EQ(batch.out[i], single)
              << rows << "x" << cols << ", " << to_string(mode) << ", " << threads << " threads, matrix " << i;
        }
      }
    }
  }
}

TEST(NewtonSchulzBatched, RestoresBlasThreads) {
  const int before = linalg::threads();
  Batch batch(4, 20, 50);
  NsOptions options;
  options.batch_mode = NsBatchMode::concurrent;
  options.threads = 2;
  newton_schulz_batched(batch.in_ptrs, batch.out_ptrs, 20, 50, options);
  EXPECT_EQ(linalg::threads(), before);
}

TEST(NewtonSchulzBatched, NamesTheBadMatrix) {
  for (NsBatchMode mode : {NsBatchMode::sequential, NsBatchMode::concurrent}) {
    Batch batch(4, 10, 20);
    batch.in[2][5] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<std::string> names = {"w0", "w1", "w2", "w3"};
    NsOptions options;
    options.batch_mode = mode;
    options.threads = 2;
    try {
      newton_schulz_batched(batch.in_ptrs, batch.out_ptrs, 10, 20, options, names);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'w2'"), std::string::npos) << e.what();
    }
  }
}

TEST(NewtonSchulzBatched, RejectsMismatchedSpans) {
  Batch batch(3, 4, 4);
  const std::vector<std::string> names = {"a", "b"};
  EXPECT_THROW(newton_schulz_batched(batch.in_ptrs, std::span<float* const>(batch.out_ptrs).first(2), 4, 4, {}), Error);
  EXPECT_THROW(newton_schulz_batched(batch.in_ptrs, batch.out_ptrs, 4, 4, {}, names), Error);
}

// A workspace larger than the pool's limit (qwen2.5-0.5b's MLP batch on a GPU) stays pooled, so every call
// reuses its memory and addresses; smaller ones beyond the limit go, and ns_release_workspaces frees the rest.
TEST(NewtonSchulzBatched, KeepsEachBackendsLargestWorkspaceWhateverTheLimit) {
  ns_release_workspaces();
  ns_set_workspace_limit(0);
  Batch big(2, 40, 100), small(2, 10, 20);
  newton_schulz_batched(big.in_ptrs, big.out_ptrs, 40, 100, NsOptions{});
  const size_t kept = ns_pooled_workspace_bytes();
  // Two 40×100 and four 40×40 float32 iterates for one matrix at a time (the CPU's preferred batch), and norms.
  EXPECT_GE(kept, sizeof(float) * (2 * 40 * 100 + 4 * 40 * 40));
  newton_schulz_batched(small.in_ptrs, small.out_ptrs, 10, 20, NsOptions{});
  EXPECT_EQ(ns_pooled_workspace_bytes(), kept);  // the same workspace was leased again (it fits)
  NsOptions concurrent;  // two queues: two workspaces; only the largest stays
  concurrent.batch_mode = NsBatchMode::concurrent;
  concurrent.threads = 2;
  newton_schulz_batched(big.in_ptrs, big.out_ptrs, 40, 100, concurrent);
  EXPECT_EQ(ns_pooled_workspace_bytes(), kept);
  ns_release_workspaces();
  EXPECT_EQ(ns_pooled_workspace_bytes(), 0u);
  ns_set_workspace_limit(size_t{1024} << 20);
}

// ns_workspace_bytes (and buffer_bytes, every Buffer's) counts the workspaces' buffers where they are allocated and
// freed: one 40×100 matrix's workspace is two 40×100 and four 40×40 float32 iterates and its norm's two float32 slots,
// alive while pooled; the peak stays after the pool is emptied, until reset.
TEST(NewtonSchulzBatched, CountsItsWorkspacesBytes) {
  ns_release_workspaces();
  ns_workspace_bytes(/*reset_peak=*/true);
  const size_t before = ns_workspace_bytes().live;  // other tests' leased workspaces: none, the pool is empty
  EXPECT_EQ(before, 0u);
  const size_t buffers_before = buffer_bytes().live;
  Batch one(1, 40, 100);
  newton_schulz_batched(one.in_ptrs, one.out_ptrs, 40, 100, NsOptions{});
  const size_t expected = sizeof(float) * (2 * 40 * 100 + 4 * 40 * 40 + 2);
  EXPECT_EQ(ns_workspace_bytes().live, expected);
  EXPECT_EQ(buffer_bytes().live - buffers_before, expected);  // every Buffer is counted: the workspace's are all
  EXPECT_EQ(ns_workspace_bytes().peak, expected);
  EXPECT_EQ(ns_pooled_workspace_bytes(), expected);
  ns_release_workspaces();
  EXPECT_EQ(ns_workspace_bytes().live, 0u);
  EXPECT_EQ(ns_workspace_bytes(/*reset_peak=*/true).peak, expected);
  EXPECT_EQ(ns_workspace_bytes().peak, 0u);
}

}  // namespace
}  // namespace dmuon
