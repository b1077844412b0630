// Element counts of tensor shapes read from files or manifests. Every reader turns a shape into a
// count before it sizes a buffer or checks a file's length, so a crafted shape must be an error
// naming the source, never a count that wrapped around or a vector that cannot be allocated.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace dmuon {

// 2^40 elements (4 TiB of float32): far above any tensor this project handles, and small enough
// that count · 16 bytes fits in int64 and std::vector<float> never throws std::length_error.
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 40;

// Product of the dimensions (1 for a scalar shape). Throws dmuon::Error "<what>: shape [..] ..."
// on a negative dimension or when the product would exceed kMaxTensorElements.
int64_t checked_numel(std::span<const int64_t> shape, std::string_view what);

// "[3, 4]"
std::string shape_text(std::span<const int64_t> shape);

}  // namespace dmuon
