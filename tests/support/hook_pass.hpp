// One forward and backward of a model without compute through the hooks of shard::ShardedParams:
// `write_grad(p, g)` fills parameter p's gradient view g during the backward; the reduce leaves the
// reduced gradients in the shards. Header-only.
#pragma once

#include <functional>
#include <span>

#include "dmuon/shard.hpp"

namespace dmuon::test {

inline void hook_pass(shard::ShardedParams& sp, const std::function<void(int p, DeviceSpan<float> g)>& write_grad) {
  for (int u = 0; u < sp.num_units(); ++u) {
    sp.before_forward(u);
    sp.after_forward(u);
  }
  for (int u = sp.num_units() - 1; u >= 0; --u) {
    sp.before_backward(u);
    for (int p : sp.layout(u).params) write_grad(p, sp.grad(p));
    sp.after_backward(u);
  }
  sp.finish_backward();
}

}  // namespace dmuon::test
