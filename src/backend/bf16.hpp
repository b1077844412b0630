// bfloat16 on the host: the upper 16 bits of a float32. Widening is exact; narrowing rounds to nearest, ties to
// even, and turns every NaN into the canonical quiet NaN 0x7fff, as CUDA's __float2bfloat16_rn does, so host
// and device conversions agree bit for bit. Header-only: the CPU backend, the GPU check and the tests share it.
#pragma once

#include <bit>
#include <cstdint>

namespace dmuon {

inline uint16_t bf16_bits(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float bf16_value(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

// x rounded to the nearest bfloat16, as a float.
inline float round_to_bf16(float x) { return bf16_value(bf16_bits(x)); }

}  // namespace dmuon
