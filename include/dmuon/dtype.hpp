// Element types and reductions: the one vocabulary of the bottom layers. Backend views (backend.hpp) and
// communicator buffers (comm.hpp) name their elements with DType; the collectives and the CUDA backend's
// block reduction name their operation with ReduceOp. Each library the engine calls (MPI, NCCL) has one
// converter from these, in the one file that includes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace dmuon {

// Storage types. Matrix products always accumulate in float32; bf16 is a GPU storage type for NS operands
// (every backend's convert takes it, so host code can hold bf16 data and compute in float32). f64, i64 and
// u8 are buffers of the collectives (norms, counts, bytes); no backend computes on them.
enum class DType { f32, bf16, f64, i64, u8 };

// How the collectives combine ranks' values. average is the sum divided by the number of ranks (floating
// dtypes only).
enum class ReduceOp { sum, average, max, min };

constexpr std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

// "float32", "bfloat16", "float64", "int64", "uint8" (torch's names).
inline std::string to_string(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::f64:
      return "float64";
    case DType::i64:
      return "int64";
    case DType::u8:
      return "uint8";
  }
  return "?";
}

inline std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::average:
      return "average";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

// The DType of a C++ element type the collectives take.
template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, int64_t>)
    return DType::i64;
  else if constexpr (std::is_same_v<T, uint8_t>)
    return DType::u8;
  else
    static_assert(sizeof(T) == 0, "the collectives take float, double, int64_t and uint8_t");
}

}  // namespace dmuon
