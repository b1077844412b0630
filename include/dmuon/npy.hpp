// NumPy .npy files (format versions 1.0, 2.0, 3.0): 2-D and other arrays of float32 or float64,
// C or Fortran order, little-endian. Values are delivered as float32 in C (row-major) order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon {

struct NpyArray {
  std::vector<int64_t> shape;  // e.g. {rows, cols}
  std::vector<float> data;     // product(shape) values, C order
  std::string source_dtype;    // "float32" or "float64", as stored in the file
};

// Throws dmuon::Error naming the file for a missing file, bad magic, malformed header,
// unsupported dtype (anything but little-endian f4/f8), or a size that does not match the shape.
NpyArray read_npy(const std::string& path);

// Writes float32, C order. Atomic: the file appears complete or not at all.
void write_npy(const std::string& path, const std::vector<int64_t>& shape, const float* data);

}  // namespace dmuon
