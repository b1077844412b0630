// Small deterministic random numbers for the GPT example (initialisation, batch sampling): the same
// seed gives the same numbers on every platform and standard library, unlike <random>'s distributions.
#pragma once

#include <cmath>
#include <cstdint>

namespace dmuon::model {

// SplitMix64 finaliser: a bijective mix of 64 bits, good enough to hash (seed, step, index) tuples.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return mix64(state_++); }
  // Uniform in (0, 1]: 53 random bits, never 0 so log() is finite.
  double uniform() { return (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53; }
  // Standard normal by Box–Muller (one of the pair; simple over fast).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace dmuon::model
