// CUDA kernels of the three copy ops: one launch per (source dtype,
// destination dtype) pair in the op, whatever the number of tensors. The plan
// (copy_plan.h: segments and their tiles) is uploaded in one host-to-device
// copy; each block binary-searches its segment and moves one tile with
// 16-byte accesses where alignment allows.

#include "copy_kernels.h"
#include "copy_plan.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

namespace megatron_fsdp {
namespace {

template <typename S, typename D>
__global__ void __launch_bounds__(kCopyThreads)
    multi_tensor_copy_kernel(const CopySegment* segments, const int64_t* first_tile, int64_t n_segments) {
  const int64_t tile = blockIdx.x;
  const int64_t seg = find_segment(first_tile, n_segments, tile);
  copy_tile<S, D>(segments[seg], tile - first_tile[seg], threadIdx.x, blockDim.x);
}

void launch_group(const CopyGroup& group, const at::Device& device, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(group.segments.size());
  const int64_t tiles = group.first_tile.back();
  if (tiles == 0) return;
  const size_t segment_bytes = n * sizeof(CopySegment);
  const size_t bytes = segment_bytes + (n + 1) * sizeof(int64_t);
  // Pinned, so the upload is asynchronous; the caching host allocator keeps
  // the buffer until the copy on `stream` has finished.
  at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), group.segments.data(), segment_bytes);
  std::memcpy(static_cast<char*>(host.data_ptr()) + segment_bytes, group.first_tile.data(), (n + 1) * sizeof(int64_t));
  const at::Tensor table = host.to(device, /*non_blocking=*/true);
  const auto* segments = reinterpret_cast<const CopySegment*>(table.data_ptr());
  const auto* first_tile = reinterpret_cast<const int64_t*>(static_cast<const char*>(table.data_ptr()) + segment_bytes);
  dispatch_copy_kind(group.kind, [&](auto s, auto d) {
    using S = typename decltype(s)::type;
    using D = typename decltype(d)::type;
    multi_tensor_copy_kernel<S, D><<<static_cast<unsigned>(tiles), kCopyThreads, 0, stream>>>(segments, first_tile, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void run_plan_on_device(const CopyPlan& plan, const at::Tensor& anchor) {
  const c10::cuda::CUDAGuard guard(anchor.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (const CopyGroup& group : plan.groups) launch_group(group, anchor.device(), stream);
  plan.run_aten_copies();
}

// A CUDA graph would capture the plan's upload from one host buffer and
// replay it after that buffer is reused: while capturing, ATen's copies run.
bool capturing(const at::Tensor& anchor) {
  const c10::cuda::CUDAGuard guard(anchor.device());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

void pack_into_cuda(at::TensorList inputs, const at::Tensor& out) {
  run_plan_on_device(plan_pack_into(inputs, out, /*use_kernel=*/!capturing(out)), out);
}

void split_copy_out_cuda(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
  run_plan_on_device(plan_split_copy_out(src, split_sizes, out, /*use_kernel=*/!capturing(src)), src);
}

void chunk_cat_cuda(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  run_plan_on_device(plan_chunk_cat(tensors, num_chunks, out, /*use_kernel=*/!capturing(out)), out);
}

}  // namespace megatron_fsdp
