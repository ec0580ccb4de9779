// pack_into: copy many tensors, flattened, back to back into one flat buffer.
//
// This is the data movement at the heart of FSDP's all-gather copy-in: many
// parameter shards into one contiguous buffer. torch does it with one small
// copy kernel per tensor; here the CPU version spreads the tensors over the
// available threads in one parallel region.

#include "pack.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

namespace megatron_fsdp {

std::vector<int64_t> check_pack_args(const std::vector<at::Tensor>& inputs, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 1, "pack_into: out must be 1-D, got ", out.dim(), " dimensions");
  TORCH_CHECK(out.is_contiguous(), "pack_into: out must be contiguous");
  std::vector<int64_t> offsets;
  offsets.reserve(inputs.size());
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    TORCH_CHECK(t.device() == out.device(), "pack_into: inputs[", i, "] is on ", t.device(),
                " but out is on ", out.device());
    TORCH_CHECK(!t.is_complex() && !out.is_complex(), "pack_into: complex tensors are not supported");
    offsets.push_back(total);
    total += t.numel();
  }
  TORCH_CHECK(total <= out.numel(), "pack_into: inputs hold ", total, " elements but out has only ",
              out.numel());
  return offsets;
}

namespace {

void pack_into_cpu(const std::vector<at::Tensor>& inputs, const at::Tensor& out) {
  const std::vector<int64_t> offsets = check_pack_args(inputs, out);
  const int64_t n = static_cast<int64_t>(inputs.size());
  // One grain per tensor: small tensors are the case this op exists for.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Tensor& t = inputs[i];
      if (t.numel() == 0) continue;
      at::Tensor dst = out.narrow(0, offsets[i], t.numel());
      if (t.is_contiguous() && t.scalar_type() == out.scalar_type()) {
        std::memcpy(dst.data_ptr(), t.data_ptr(), t.numel() * t.element_size());
      } else {
        dst.copy_(t.reshape(-1));  // strided or casting copy
      }
    }
  });
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY(megatron_fsdp, m) {
  m.def("pack_into(Tensor[] inputs, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("pack_into", &megatron_fsdp::pack_into_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("has_cuda") = pybind11::bool_(
#ifdef MEGATRON_FSDP_WITH_CUDA
      true
#else
      false
#endif
  );
}
