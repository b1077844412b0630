// Batches for the GPT example: a global batch is a pure function of (seed, step); ranks and micro-batches
// read contiguous slices of it, so the data a step sees does not depend on how many ranks share it.
#include "dmuon/data.hpp"
#include "dmuon/error.hpp"
#include "model/random.hpp"

namespace dmuon {

std::vector<int64_t> global_batch_starts(int64_t stream_size, int64_t B, int64_t T, uint64_t seed, int64_t step) {
  DMUON_CHECK(B >= 1 && T >= 1, "batch size ", B, " and sequence length ", T, " must be at least 1");
  DMUON_CHECK(stream_size >= T + 1, "token stream of ", stream_size, " tokens is shorter than one sequence of ", T + 1,
              " tokens (T+1)");
  DMUON_CHECK(step >= 0, "batch step must be non-negative, got ", step);
  const auto positions = static_cast<uint64_t>(stream_size - T);  // valid starts: [0, stream_size − T − 1]
  const uint64_t step_key = model::mix64(model::mix64(seed) ^ static_cast<uint64_t>(step));
  std::vector<int64_t> starts(B);
  for (int64_t i = 0; i < B; i++) {
    // Modulo bias is below positions/2^64: irrelevant for any corpus that fits in memory.
    starts[i] = static_cast<int64_t>(model::mix64(step_key ^ model::mix64(static_cast<uint64_t>(i))) % positions);
  }
  return starts;
}

TokenBatch sample_batch(const std::vector<uint8_t>& stream, int64_t B, int64_t T, uint64_t seed, int64_t step,
                        const BatchSlice& s) {
  DMUON_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world, "rank ", s.rank, " outside world size ", s.world);
  DMUON_CHECK(s.micro_batches >= 1 && s.micro >= 0 && s.micro < s.micro_batches, "micro-batch ", s.micro,
              " outside [0, ", s.micro_batches, ")");
  DMUON_CHECK(B % s.world == 0, "global batch size ", B, " is not divisible by the number of ranks ", s.world);
  const int64_t per_rank = B / s.world;
  DMUON_CHECK(per_rank % s.micro_batches == 0, "per-rank batch ", per_rank, " (global batch ", B, " over ", s.world,
              " ranks) is not divisible by ", s.micro_batches, " micro-batches");
  const std::vector<int64_t> starts = global_batch_starts(static_cast<int64_t>(stream.size()), B, T, seed, step);
  TokenBatch batch;
  batch.rows = per_rank / s.micro_batches;
  batch.T = T;
  batch.inputs.resize(batch.rows * T);
  batch.targets.resize(batch.rows * T);
  const int64_t first = s.rank * per_rank + s.micro * batch.rows;
  for (int64_t r = 0; r < batch.rows; r++) {
    const uint8_t* seq = stream.data() + starts[first + r];  // T+1 tokens
    for (int64_t t = 0; t < T; t++) {
      batch.inputs[r * T + t] = seq[t];
      batch.targets[r * T + t] = seq[t + 1];
    }
  }
  return batch;
}

}  // namespace dmuon
