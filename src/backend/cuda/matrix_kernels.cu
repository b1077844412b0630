// Elementwise and reduction kernels on (batched, strided, f32 or bf16) matrix views: convert, fill, scale,
// add-identity, mirror, transpose, Frobenius norms and the normalisation by them (DESIGN 2.1). Every op
// computes in float and rounds once when it stores, as the CPU backend does in float32.
#include "backend/cuda/device_view.cuh"
#include "backend/cuda/kernels.hpp"
#include "backend/cuda/tile_grid.hpp"

namespace dmuon::cuda {

namespace {

constexpr int kTile = 32;  // transposing tiles: kTile×kTile through shared memory, kTile×8 threads

// (b, r, c) of element i of a batch of rows×cols matrices.
struct Index {
  int64_t b, r, c;
};
__device__ Index index_of(const DeviceView& x, int64_t i) {
  const int64_t per = x.rows * x.cols;
  const int64_t b = i / per, rc = i - b * per, r = rc / x.cols;
  return {b, r, rc - r * x.cols};
}

__global__ void convert_kernel(DeviceView in, DeviceView out) {
  const int64_t total = in.rows * in.cols * in.count;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const Index e = index_of(in, i);
    out.store(out.at(e.b, e.r, e.c), in.load(in.at(e.b, e.r, e.c)));
  }
}

__global__ void fill_kernel(DeviceView x, float value) {
  const int64_t total = x.rows * x.cols * x.count;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const Index e = index_of(x, i);
    x.store(x.at(e.b, e.r, e.c), value);
  }
}

__global__ void scale_kernel(DeviceView x, float alpha) {
  const int64_t total = x.rows * x.cols * x.count;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const Index e = index_of(x, i);
    const int64_t o = x.at(e.b, e.r, e.c);
    x.store(o, __fmul_rn(x.load(o), alpha));
  }
}

__global__ void add_identity_kernel(DeviceView c, float alpha) {
  const int64_t total = c.rows * c.count;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const int64_t b = i / c.rows, d = i - b * c.rows;
    const int64_t o = c.at(b, d, d);
    c.store(o, __fadd_rn(c.load(o), alpha));
  }
}

// Block (X, y, b) moves tile (Y, X) of `in` to tile (X, Y) of `out`, for the row tiles Y = y, y + gridDim.y, …
// below row_tiles (tile_grid.hpp). The loop's bounds depend on the block alone, so every thread meets each barrier.
__global__ void transpose_kernel(DeviceView in, DeviceView out, int64_t row_tiles) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t b = blockIdx.z, c0 = int64_t{blockIdx.x} * kTile;
  for (int64_t ty = blockIdx.y; ty < row_tiles; ty += gridDim.y) {
    const int64_t r0 = ty * kTile;
    for (int j = threadIdx.y; j < kTile; j += blockDim.y) {
      const int64_t r = r0 + j, c = c0 + threadIdx.x;
      if (r < in.rows && c < in.cols) tile[j][threadIdx.x] = in.load(in.at(b, r, c));
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += blockDim.y) {
      const int64_t r = c0 + j, c = r0 + threadIdx.x;  // out(r, c) = in(c, r)
      if (r < in.cols && c < in.rows) out.store(out.at(b, r, c), tile[threadIdx.x][j]);
    }
    __syncthreads();  // the next row tile overwrites `tile`
  }
}

// Block (X, y, b) fills, for each row tile Y = y, y + gridDim.y, … with Y ≥ X, the below-diagonal part of tile (Y, X)
// from tile (X, Y). The diagonal tile reads all of itself before it writes (the barrier), so reads never see a
// write.
__global__ void mirror_kernel(DeviceView c, int64_t row_tiles) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t b = blockIdx.z, col0 = int64_t{blockIdx.x} * kTile;
  for (int64_t ty = blockIdx.y; ty < row_tiles; ty += gridDim.y) {
    if (ty < blockIdx.x) continue;
    const int64_t row0 = ty * kTile;
    for (int j = threadIdx.y; j < kTile; j += blockDim.y) {
      const int64_t r = col0 + j, s = row0 + threadIdx.x;  // the source tile (X, Y)
      if (r < c.rows && s < c.rows) tile[j][threadIdx.x] = c.load(c.at(b, r, s));
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += blockDim.y) {
      const int64_t r = row0 + j, s = col0 + threadIdx.x;  // c(r, s) = c(s, r)
      if (r < c.rows && s < c.rows && r > s) c.store(c.at(b, r, s), tile[threadIdx.x][j]);
    }
    __syncthreads();  // the next row tile overwrites `tile`
  }
}

__global__ void scale_by_inverse_norm_kernel(DeviceView x, const double* norms, double safety, double eps) {
  const int64_t total = x.rows * x.cols * x.count;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const Index e = index_of(x, i);
    // 1 / (‖x‖·safety + eps) rounded after each operation, as the CPU computes it (nvcc would fuse a * b + c).
    const float s = static_cast<float>(__ddiv_rn(1.0, __dadd_rn(__dmul_rn(norms[e.b], safety), eps)));
    const int64_t o = x.at(e.b, e.r, e.c);
    x.store(o, __fmul_rn(x.load(o), s));
  }
}

// Element i of matrix b of a view, for the reductions.
struct ViewLoad {
  DeviceView x;
  __device__ double operator()(int64_t b, int64_t i) const {
    const int64_t r = i / x.cols;
    return x.load(x.at(b, r, i - r * x.cols));
  }
};

dim3 blocks(const TileGrid& g) { return dim3(g.x, g.y, g.z); }

}  // namespace

void launch_convert(const MatView& in, const MatView& out, cudaStream_t stream) {
  if (in.empty()) return;
  convert_kernel<<<grid_for(in.elements() * in.count), kThreads, 0, stream>>>(device_view(in), device_view(out));
  check_launch();
}

void launch_fill(const MatView& x, float value, cudaStream_t stream) {
  if (x.empty()) return;
  fill_kernel<<<grid_for(x.elements() * x.count), kThreads, 0, stream>>>(device_view(x), value);
  check_launch();
}

void launch_scale(const MatView& x, float alpha, cudaStream_t stream) {
  if (x.empty()) return;
  scale_kernel<<<grid_for(x.elements() * x.count), kThreads, 0, stream>>>(device_view(x), alpha);
  check_launch();
}

void launch_add_identity(const MatView& c, float alpha, cudaStream_t stream) {
  if (c.empty()) return;
  add_identity_kernel<<<grid_for(c.rows * c.count), kThreads, 0, stream>>>(device_view(c), alpha);
  check_launch();
}

void launch_mirror_upper(const MatView& c, cudaStream_t stream) {
  if (c.empty()) return;
  const TileGrid g = tile_grid(c.rows, c.rows, c.count, kTile);
  mirror_kernel<<<blocks(g), dim3(kTile, 8), 0, stream>>>(device_view(c), g.row_tiles);
  check_launch();
}

void launch_transpose(const MatView& in, const MatView& out, cudaStream_t stream) {
  if (in.empty()) return;
  const TileGrid g = tile_grid(in.rows, in.cols, in.count, kTile);
  transpose_kernel<<<blocks(g), dim3(kTile, 8), 0, stream>>>(device_view(in), device_view(out), g.row_tiles);
  check_launch();
}

void launch_frobenius_norms(const MatView& x, double* norms, cudaStream_t stream) {
  if (x.count == 0) return;
  if (x.elements() == 0) {
    DMUON_CUDA_CHECK(cudaMemsetAsync(norms, 0, sizeof(double) * x.count, stream));
    return;
  }
  sums_of_squares(ViewLoad{device_view(x)}, x.elements(), x.count, true, norms, stream);
}

void launch_scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps,
                                  cudaStream_t stream) {
  if (x.empty()) return;
  scale_by_inverse_norm_kernel<<<grid_for(x.elements() * x.count), kThreads, 0, stream>>>(device_view(x), norms,
                                                                                          safety, eps);
  check_launch();
}

}  // namespace dmuon::cuda
