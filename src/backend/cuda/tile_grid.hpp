// The launch grids of the CUDA backend's tile kernels (transpose, mirror: matrix_kernels.cu) and of its sums of
// squares (device_view.cuh), plain C++ so that they are tested without a device. Tile kernels: x over the column tiles, y over the row tiles, z over the batch. CUDA allows at most
// 65535 blocks in y and z: past 65535 row tiles (2.1 M rows of 32-row tiles) y stays at 65535 and the kernels
// stride over the row tiles (row tile ty, ty + y, …); a batch of more than 65535 matrices is refused.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dmuon/error.hpp"

namespace dmuon::cuda {

constexpr int64_t kMaxGridYZ = 65535;

struct TileGrid {
  unsigned x = 0, y = 0, z = 0;  // blocks
  int64_t row_tiles = 0;         // what the y blocks stride over
};

inline TileGrid tile_grid(int64_t rows, int64_t cols, int64_t count, int64_t tile) {
  DMUON_CHECK(count <= kMaxGridYZ, "CUDA tile kernels: batch of ", count, " matrices exceeds ", kMaxGridYZ);
  const int64_t col_tiles = (cols + tile - 1) / tile, row_tiles = (rows + tile - 1) / tile;
  DMUON_CHECK(col_tiles <= INT32_MAX, "CUDA tile kernels: ", cols, " columns exceed the grid");
  return {static_cast<unsigned>(col_tiles), static_cast<unsigned>(std::min(row_tiles, kMaxGridYZ)),
          static_cast<unsigned>(count), row_tiles};
}

// Sums of squares of `count` vectors of `per_matrix` values each (matrices, or NorMuon's rows): x over `parts` blocks
// per vector (at least 16 threads' worth of values each, at most 128 blocks), y over the vectors, at most 65535 (a
// vocabulary's rows are more): past it the kernel strides over them (vector b, b + y, …).
struct ReductionGrid {
  unsigned parts = 0, y = 0;
};

inline ReductionGrid reduction_grid(int64_t per_matrix, int64_t count, int64_t threads) {
  DMUON_CHECK(count >= 1, "CUDA reduction of ", count, " vectors");
  return {static_cast<unsigned>(std::clamp<int64_t>(per_matrix / (threads * 16), 1, 128)),
          static_cast<unsigned>(std::min(count, kMaxGridYZ))};
}

}  // namespace dmuon::cuda
