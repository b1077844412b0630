// Parameters and gradients of a made-up model for optimizer tests: random (seeded) initial values,
// gradients a fixed smooth function of (parameter, element, step, sample). Header-only.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "dmuon/optim.hpp"

namespace dmuon::test {

struct ToyModel {
  std::vector<ParamSpec> specs;
  std::vector<std::vector<float>> values, grads;  // per parameter, numel values, C order

  ToyModel(std::vector<ParamSpec> param_specs, uint32_t seed) : specs(std::move(param_specs)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    for (const ParamSpec& s : specs) {
      values.emplace_back(s.numel());
      grads.emplace_back(s.numel());
      for (float& v : values.back()) v = d(rng);
    }
  }
  // Whole tensors, as a single process holds them.
  std::vector<ParamRef> refs() {
    std::vector<ParamRef> r;
    for (size_t i = 0; i < specs.size(); ++i) r.push_back({specs[i], values[i].data(), grads[i].data()});
    return r;
  }
  // Rank r's part of every tensor under an even split over w ranks (as shard::even_split cuts one tensor).
  std::vector<ParamRef> slice_refs(int r, int w) {
    std::vector<ParamRef> refs = this->refs();
    for (ParamRef& p : refs) {
      const int64_t n = p.spec.numel(), lo = n * r / w, hi = n * (r + 1) / w;
      p.values += lo, p.grad += lo, p.offset = lo, p.count = hi - lo;
    }
    return refs;
  }
  // Gradient of sample j at step t for element i of parameter p.
  static float sample_grad(size_t p, size_t i, int t, int j = 0) {
    return std::sin(0.37f * i + 1.3f * p + 0.7f * t + 0.11f * j);
  }
  void set_grads(int t) {
    for (size_t p = 0; p < grads.size(); ++p)
      for (size_t i = 0; i < grads[p].size(); ++i) grads[p][i] = sample_grad(p, i, t);
  }
};

}  // namespace dmuon::test
