// Kernels for fp8 training: the amax of many tensors at once (weight scales)
// and the scaled, saturating cast to fp8 bytes (the all-gather input).
#pragma once

// The Tensor class alone: ATen/ATen.h (every operator) would triple the compile time.
#include <ATen/core/Tensor.h>

#include <vector>

#include "fp8_plan.h"

namespace megatron_fsdp {

// Checks (all tensors on one device, each float32/bfloat16/float16/float64)
// and returns the device; throws naming the offending index before any work.
void check_amax_args(at::TensorList tensors);

// max(|t|) of each tensor as a float32 [n] tensor on the tensors' device:
// 0 for an empty tensor, NaN for one holding a NaN.
at::Tensor multi_tensor_amax_cpu(at::TensorList tensors);
at::Tensor multi_tensor_amax_meta(at::TensorList tensors);

// The device kernel's work list: the tensors grouped by dtype (one launch
// each), their tiles numbered consecutively.
struct AmaxGroup {
  at::ScalarType dtype;
  std::vector<AmaxSegment> segments;
  std::vector<int64_t> first_tile;  // per segment, plus the total at the end
};
struct AmaxPlan {
  std::vector<AmaxGroup> groups;
  std::vector<at::Tensor> contiguous;  // copies of non-contiguous inputs, alive until the kernels ran
};
AmaxPlan plan_multi_tensor_amax(at::TensorList tensors);

// The device kernel's plan run on the host, block by block.
at::Tensor multi_tensor_amax_emulated(at::TensorList tensors);

// out (uint8, src's numel) = fp8 bits of clamp(float(src) * scale, -max, max),
// max the largest finite value of `dtype` (float8_e4m3fn or float8_e5m2);
// scale a one-element float32 tensor on src's device.
void check_cast_to_fp8_args(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                            const at::Tensor& out);
void cast_to_fp8_cpu(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype, const at::Tensor& out);

// cast-transpose: one read of a 2-D src [M, K] (any strides) writes
//   out   (uint8 [M, K], contiguous)  = the fp8 bits of clamp(float(src) * scale, -max, max),
//   out_t (uint8 [K, Mt], contiguous, Mt >= M) = those bits transposed, columns M.. zero
//          (the token padding an fp8 GEMM operand needs: zero bytes are +0.0),
//   amax  (float32, one element) = max |src| (0 for no elements, NaN if src holds one).
// out is the row-major operand of torch._scaled_mm, out_t.t() the column-major one.
void check_cast_transpose_to_fp8_args(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                                      const at::Tensor& out, const at::Tensor& out_t, const at::Tensor& amax);
void cast_transpose_to_fp8_cpu(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                               const at::Tensor& out, const at::Tensor& out_t, const at::Tensor& amax);

#ifdef MEGATRON_FSDP_WITH_CUDA
at::Tensor multi_tensor_amax_cuda(at::TensorList tensors);
void cast_to_fp8_cuda(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype, const at::Tensor& out);
void cast_transpose_to_fp8_cuda(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                                const at::Tensor& out, const at::Tensor& out_t, const at::Tensor& amax);
#endif

}  // namespace megatron_fsdp
