// A training configuration small enough for tests: a GPT of width 32, 2 heads, context 16, on the
// fortunes corpus, 2 warmup steps, validation only when asked (2 batches).
#pragma once

#include <cstdint>

#include "dmuon/trainer.hpp"

namespace dmuon::test {

inline TrainOptions tiny_training(OptimKind optim, int64_t steps, int64_t layers, int64_t batch) {
  TrainOptions o;
  o.model = {.vocab = 256, .context = 16, .layers = layers, .heads = 2, .width = 32};
  o.optim = optim;
  o.steps = steps;
  o.batch = batch;
  o.warmup = 2;
  o.val_every = 0;
  o.val_batches = 2;
  return o;
}

}  // namespace dmuon::test
