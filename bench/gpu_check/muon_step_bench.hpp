// `dmuon_gpu_check bench muon`: one Muon step on a device over a model's matrices, as DMuon runs it on one GPU
// (DESIGN 1 and 3, the replicated case): per bucket of same-shape matrices, the momentum of every matrix into one
// float32 stack (muon_momentum), Newton–Schulz of the stack as one batch (bf16 iterates, the device default:
// automatic algorithm, restarts [1, 3]), and W ← W − lr·s·O per matrix (muon_apply). Weights and gradients are
// random (never zeros); the timed steps follow one untimed step (workspaces, cuBLAS heuristics, CUDA graphs).
// Each step is timed whole with CUDA events (time_queued); the report gives the median, and the median time of each
// bucket's Newton–Schulz alone. The torch counterpart is python/benchmarks/muon_step_torch.py (torch.optim.Muon
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
};

struct MuonStepReport {
  std::string device;
  int repeats = 0;
  int64_t parameters = 0;  // Σ rows·cols·count
  double step_seconds = 0;  // median of whole steps
  std::vector<double> step_seconds_all;
  std::vector<MuonBucket> buckets;
};

// "896x896:48,128x896:48" → buckets (":K" omitted: one matrix); throws naming the bad item.
std::vector<MuonBucket> parse_buckets(const std::string& list);

MuonStepReport bench_muon_step(Backend& backend, std::vector<MuonBucket> buckets, int repeats);

std::string muon_step_json(const MuonStepReport& report);
std::string muon_step_table(const MuonStepReport& report);

}  // namespace dmuon
