// `dmuon_gpu_check bench muon`: one Muon step on a device over a model's matrices, as DMuon runs it on one GPU
// (DESIGN 1 and 3, the replicated case): per bucket of same-shape matrices, the momentum of every matrix into one
// float32 stack (muon_momentum), Newton–Schulz of the stack as one batch (bf16 iterates, the device default:
// automatic algorithm, restarts [1, 3]), and W ← W − lr·s·O per matrix (muon_apply). Weights and gradients are
// random (never zeros); the timed steps follow two untimed ones: the first grows Newton–Schulz's workspace bucket by
// bucket (cuBLAS heuristics too), which frees buffers that the graphs of the buckets before named, so the second
// records those again at the workspace's final addresses, and every timed step replays.
// Each step is timed whole with CUDA events (time_queued); the report gives the median, and the median time of each
// bucket's Newton–Schulz alone. An exception in the steps is kept in the report's `error`, one in a bucket's own
// Newton–Schulz in that bucket's, and the other buckets are still timed. The torch counterpart is python/benchmarks/muon_step_torch.py (torch.optim.Muon
// on the same matrices).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"

namespace dmuon {

struct MuonBucket {
  int64_t rows = 0, cols = 0, count = 0;
  double ns_seconds = 0;  // median of this bucket's Newton–Schulz alone
  std::string error;      // what its Newton–Schulz threw; empty: none
};

struct MuonStepReport {
  std::string device;
  int repeats = 0;
  int64_t parameters = 0;  // Σ rows·cols·count
  double step_seconds = 0;  // median of whole steps
  std::vector<double> step_seconds_all;
  std::string error;  // what the steps threw (no step time then); empty: none
  std::vector<MuonBucket> buckets;
};

// "896x896:48,128x896:48" → buckets (":K" omitted: one matrix); throws naming the bad item.
std::vector<MuonBucket> parse_buckets(const std::string& list);

MuonStepReport bench_muon_step(Backend& backend, std::vector<MuonBucket> buckets, int repeats);

std::string muon_step_json(const MuonStepReport& report);
std::string muon_step_table(const MuonStepReport& report);
// One "FAIL bench muon ..." line per error of the report (empty when none).
std::string muon_step_failures(const MuonStepReport& report);

}  // namespace dmuon
