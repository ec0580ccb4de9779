// CUDA pack_into: all same-dtype contiguous inputs in one launch per batch of
// up to kMaxTensors tensors; blockIdx.y picks the tensor, blocks stride over it.

#include "pack.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace megatron_fsdp {
namespace {

constexpr int kMaxTensors = 64;

struct CopyBatch {
  const char* src[kMaxTensors];
  char* dst[kMaxTensors];
  int64_t bytes[kMaxTensors];
};

__global__ void multi_tensor_copy_kernel(CopyBatch batch) {
  const int t = blockIdx.y;
  const char* src = batch.src[t];
  char* dst = batch.dst[t];
  const int64_t bytes = batch.bytes[t];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes; i += stride) {
    dst[i] = src[i];
  }
}

void pack_into_cuda(const std::vector<at::Tensor>& inputs, const at::Tensor& out) {
  const std::vector<int64_t> offsets = check_pack_args(inputs, out);
  const c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  CopyBatch batch;
  int count = 0;
  int64_t max_bytes = 0;
  auto flush = [&]() {
    if (count == 0) return;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((max_bytes + threads - 1) / threads, 1024);
    multi_tensor_copy_kernel<<<dim3(static_cast<unsigned>(blocks), count), threads, 0, stream>>>(batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    count = 0;
    max_bytes = 0;
  };
  char* base = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (t.numel() == 0) continue;
    if (!t.is_contiguous() || t.scalar_type() != out.scalar_type()) {
      out.narrow(0, offsets[i], t.numel()).copy_(t.reshape(-1));
      continue;
    }
    batch.src[count] = static_cast<const char*>(t.data_ptr());
    batch.dst[count] = base + offsets[i] * out.element_size();
    batch.bytes[count] = t.numel() * t.element_size();
    max_bytes = std::max(max_bytes, batch.bytes[count]);
    if (++count == kMaxTensors) flush();
  }
  flush();
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("pack_into", &megatron_fsdp::pack_into_cuda);
}
