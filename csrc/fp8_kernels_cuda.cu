// CUDA kernels for fp8 training.
//
// multi_tensor_amax: one launch per input dtype (normally one), whatever the
// number of tensors. The plan (fp8_kernels.cpp) is uploaded in one
// host-to-device copy; each block finds its tensor by binary search, reduces
// one tile (fp8_plan.h) and combines its result with atomicMax on the
// float32 bits of the output, zeroed first (the value of an empty tensor).
// cast_to_fp8: elementwise, c10's conversion, the scale read on the device.
// cast_transpose_to_fp8: the same cast, written twice (row-major and
// transposed) from one read, with the amax on the way (kernel below).

#include "fp8_kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

namespace megatron_fsdp {
namespace {

__device__ inline uint32_t warp_max(uint32_t m) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, m, offset);
    m = other > m ? other : m;
  }
  return m;
}

template <typename T>
__global__ void __launch_bounds__(kAmaxThreads)
    multi_tensor_amax_kernel(const AmaxSegment* segments, const int64_t* first_tile, int64_t n_segments,
                             uint32_t* out_bits) {
  __shared__ uint32_t warp_results[kAmaxThreads / 32];
  const int64_t tile = blockIdx.x;
  const int64_t s = find_segment(first_tile, n_segments, tile);
  const AmaxSegment seg = segments[s];
  uint32_t m = warp_max(amax_tile<T>(seg, tile - first_tile[s], threadIdx.x, blockDim.x));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_results[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = warp_max(lane < kAmaxThreads / 32 ? warp_results[lane] : 0u);
    if (lane == 0) atomicMax(out_bits + seg.out_index, m);
  }
}

void launch_amax_group(const AmaxGroup& group, const at::Device& device, cudaStream_t stream, uint32_t* out_bits) {
  const int64_t n = static_cast<int64_t>(group.segments.size());
  const int64_t tiles = group.first_tile.back();
  if (tiles == 0) return;
  const size_t segment_bytes = n * sizeof(AmaxSegment);
  const size_t bytes = segment_bytes + (n + 1) * sizeof(int64_t);
  // Pinned, so the upload is asynchronous; the caching host allocator keeps
  // the buffer until the copy on `stream` has finished.
  at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), group.segments.data(), segment_bytes);
  std::memcpy(static_cast<char*>(host.data_ptr()) + segment_bytes, group.first_tile.data(), (n + 1) * sizeof(int64_t));
  const at::Tensor table = host.to(device, /*non_blocking=*/true);
  const auto* segments = reinterpret_cast<const AmaxSegment*>(table.data_ptr());
  const auto* first_tile = reinterpret_cast<const int64_t*>(static_cast<const char*>(table.data_ptr()) + segment_bytes);
  dispatch_amax_dtype(group.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    multi_tensor_amax_kernel<T><<<static_cast<unsigned>(tiles), kAmaxThreads, 0, stream>>>(segments, first_tile, n,
                                                                                           out_bits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// A CUDA graph would capture the plan's upload from one host buffer and
// replay it after that buffer is reused: while capturing, ATen computes.
bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

template <typename S, typename F8>
__global__ void cast_to_fp8_kernel(const S* src, const float* scale, uint8_t* out, int64_t n, float max) {
  const float s = *scale;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride) {
    out[k] = scaled_fp8_bits<S, F8>(src[k], s, max);
  }
}

// cast-transpose: a block of 32 x 8 threads takes 32 x 32 tiles of src, each thread 4 of a
// tile's rows; a warp reads and writes along a row of src and out (coalesced), then along a
// row of out_t out of the tile in shared memory (one column padded: no bank conflicts).
constexpr int kTile = 32;
constexpr int kTileRowsPerPass = 8;

template <typename S, typename F8>
__global__ void __launch_bounds__(kTile * kTileRowsPerPass)
    cast_transpose_to_fp8_kernel(const S* src, int64_t s0, int64_t s1, int64_t m, int64_t k, const float* scale,
                                 float max, uint8_t* out, uint8_t* out_t, int64_t mt, uint32_t* amax_bits) {
  using Bits = typename AmaxTraits<S>::Bits;
  __shared__ uint8_t tile[kTile][kTile + 1];
  const float sc = *scale;
  const int64_t row_tiles = (m + kTile - 1) / kTile;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  Bits bits = 0;
  for (int64_t ti = blockIdx.y; ti < row_tiles; ti += gridDim.y) {
    const int64_t i0 = ti * kTile;
    for (int r = threadIdx.y; r < kTile; r += kTileRowsPerPass) {
      const int64_t i = i0 + r, j = j0 + threadIdx.x;
      if (i < m && j < k) {
        const S x = src[i * s0 + j * s1];
        const Bits b = abs_bits(x);
        bits = b > bits ? b : bits;
        const uint8_t v = scaled_fp8_bits<S, F8>(x, sc, max);
        out[i * k + j] = v;
        tile[r][threadIdx.x] = v;
      }
    }
    __syncthreads();
    for (int r = threadIdx.y; r < kTile; r += kTileRowsPerPass) {
      const int64_t j = j0 + r, i = i0 + threadIdx.x;
      if (j < k && i < m) out_t[j * mt + i] = tile[threadIdx.x][r];
    }
    __syncthreads();  // the tile is refilled by the next pass
  }
  const uint32_t m32 = warp_max(AmaxTraits<S>::float_bits(bits));
  if (threadIdx.x == 0) atomicMax(amax_bits, m32);  // lane 0 of each warp (a warp is one threadIdx.y)
}

}  // namespace

at::Tensor multi_tensor_amax_cuda(at::TensorList tensors) {
  check_amax_args(tensors);
  TORCH_CHECK(!tensors.empty(), "multi_tensor_amax: no tensors");
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::zeros({static_cast<int64_t>(tensors.size())}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (capturing()) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].numel() > 0) out.select(0, static_cast<int64_t>(i)).copy_(tensors[i].abs().amax());
    }
    return out;
  }
  const AmaxPlan plan = plan_multi_tensor_amax(tensors);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (const AmaxGroup& group : plan.groups) {
    launch_amax_group(group, device, stream, reinterpret_cast<uint32_t*>(out.data_ptr()));
  }
  return out;
}

void cast_to_fp8_cuda(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype, const at::Tensor& out) {
  check_cast_to_fp8_args(src, scale, dtype, out);
  const int64_t n = src.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  const at::Tensor s = src.contiguous();
  constexpr int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 1 << 16);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_amax_dtype(s.scalar_type(), [&](auto src_tag) {
    using S = typename decltype(src_tag)::type;
    dispatch_fp8_dtype(dtype, [&](auto fp8_tag, float max) {
      using F8 = typename decltype(fp8_tag)::type;
      cast_to_fp8_kernel<S, F8><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
          static_cast<const S*>(s.data_ptr()), static_cast<const float*>(scale.data_ptr()),
          static_cast<uint8_t*>(out.data_ptr()), n, max);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void cast_transpose_to_fp8_cuda(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                                const at::Tensor& out, const at::Tensor& out_t, const at::Tensor& amax) {
  check_cast_transpose_to_fp8_args(src, scale, dtype, out, out_t, amax);
  const int64_t m = src.size(0), k = src.size(1), mt = out_t.size(1);
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The amax is combined with atomicMax on its float32 bits: 0 first (also the value for no elements).
  C10_CUDA_CHECK(cudaMemsetAsync(amax.data_ptr(), 0, sizeof(float), stream));
  if (mt > m && k > 0) {  // the padding columns of out_t
    C10_CUDA_CHECK(cudaMemset2DAsync(static_cast<uint8_t*>(out_t.data_ptr()) + m, static_cast<size_t>(mt), 0,
                                     static_cast<size_t>(mt - m), static_cast<size_t>(k), stream));
  }
  if (m == 0 || k == 0) return;
  const int64_t col_tiles = (k + kTile - 1) / kTile, row_tiles = (m + kTile - 1) / kTile;
  TORCH_CHECK(col_tiles <= INT32_MAX, "cast_transpose_to_fp8: src has too many columns (", k, ")");
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(std::min<int64_t>(row_tiles, 65535)));
  const dim3 block(kTile, kTileRowsPerPass);
  dispatch_amax_dtype(src.scalar_type(), [&](auto src_tag) {
    using S = typename decltype(src_tag)::type;
    dispatch_fp8_dtype(dtype, [&](auto fp8_tag, float max) {
      using F8 = typename decltype(fp8_tag)::type;
      cast_transpose_to_fp8_kernel<S, F8><<<grid, block, 0, stream>>>(
          static_cast<const S*>(src.data_ptr()), src.stride(0), src.stride(1), m, k,
          static_cast<const float*>(scale.data_ptr()), max, static_cast<uint8_t*>(out.data_ptr()),
          static_cast<uint8_t*>(out_t.data_ptr()), mt, reinterpret_cast<uint32_t*>(amax.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace megatron_fsdp
