// Declarations shared by the extension's translation units.
#pragma once

// The Tensor class alone: ATen/ATen.h (every operator) would triple the compile time.
#include <ATen/core/Tensor.h>

#include <vector>

namespace megatron_fsdp {

// Contiguous, with no lazy conjugate or negative bit: its bytes are its
// values, so raw copies of them are right. Anything else takes ATen's copy.
inline bool is_plain(const at::Tensor& t) { return t.is_contiguous() && !t.is_conj() && !t.is_neg(); }

// Argument checks: each throws, naming the offending index and value, before
// any write; CPU and CUDA kernels run the same ones.

// Offset of each input in `out` (elements).
std::vector<int64_t> check_pack_args(at::TensorList inputs, const at::Tensor& out);

// Offset of each split in a row of `src` (elements).
std::vector<int64_t> check_split_copy_out_args(const at::Tensor& src, at::IntArrayRef split_sizes,
                                               at::TensorList out);

// Where each tensor's chunks go in a row of `out`.
struct ChunkCatLayout {
  int64_t row_numel = 0;               // elements per row of out
  std::vector<int64_t> col_offset;     // first column of tensor i in every row
  std::vector<int64_t> chunk_rows;     // dim-0 rows per chunk (ceil)
  std::vector<int64_t> inner;          // elements per dim-0 row
  std::vector<int64_t> rows;           // dim-0 size

  // Rows [first, first + valid / inner) of tensor i go to chunk r.
  int64_t first_row(int64_t i, int64_t r) const { return std::min(r * chunk_rows[i], rows[i]); }
  int64_t valid(int64_t i, int64_t r) const {
    return (std::min((r + 1) * chunk_rows[i], rows[i]) - first_row(i, r)) * inner[i];
  }
  int64_t chunk_numel(int64_t i) const { return chunk_rows[i] * inner[i]; }
};
ChunkCatLayout check_chunk_cat_args(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out);

void pack_into_cpu(at::TensorList inputs, const at::Tensor& out);
void split_copy_out_cpu(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out);
void chunk_cat_cpu(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out);

// The device kernels' copy plans run on the host, thread by thread: lets CI
// (no GPU) test the CUDA kernels' indexing, alignment and cast logic.
void pack_into_emulated(at::TensorList inputs, const at::Tensor& out);
void split_copy_out_emulated(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out);
void chunk_cat_emulated(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out);

#ifdef MEGATRON_FSDP_WITH_CUDA
void pack_into_cuda(at::TensorList inputs, const at::Tensor& out);
void split_copy_out_cuda(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out);
void chunk_cat_cuda(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out);
#endif

}  // namespace megatron_fsdp
