// Shared declarations of the megatron_fsdp extension.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace megatron_fsdp {

// Checks every argument of pack_into and returns each input's offset in `out`
// (elements). Throws with the offending index and value before any write.
std::vector<int64_t> check_pack_args(const std::vector<at::Tensor>& inputs, const at::Tensor& out);

}  // namespace megatron_fsdp
