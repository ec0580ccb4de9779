// cast-transpose to fp8 on the CPU (see fp8_kernels.h): the checks every
// device shares, and the kernel. The rows are cut into blocks of kRows; each
// block is one item of one parallel region and walks its rows in tiles of
// kRows x kCols: each row piece is cast into out (a loop over contiguous
// elements, which vectorizes), then the tile, still in cache, is copied
// transposed into out_t in kRows-byte runs.

#include "fp8_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace megatron_fsdp {
namespace {

constexpr int64_t kRows = 64;
constexpr int64_t kCols = 64;

// One row piece: out[j] = fp8 bits of in[j * stride] (scaled, saturated); returns max |in| as
// the input's bits. With stride 1 (the usual, a contiguous input) the loop vectorizes.
template <typename S, typename F8, bool kContiguous>
typename AmaxTraits<S>::Bits cast_row(const S* __restrict in, int64_t stride, uint8_t* __restrict out,
                                      int64_t n, float scale, float max) {
  typename AmaxTraits<S>::Bits bits = 0;
  for (int64_t j = 0; j < n; ++j) {
    const S x = in[kContiguous ? j : j * stride];
    const auto b = abs_bits(x);
    bits = b > bits ? b : bits;
    out[j] = scaled_fp8_bits<S, F8>(x, scale, max);
  }
  return bits;
}

}  // namespace

void check_cast_transpose_to_fp8_args(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                                      const at::Tensor& out, const at::Tensor& out_t, const at::Tensor& amax) {
  TORCH_CHECK(dispatch_fp8_dtype(dtype, [](auto, float) {}), "cast_transpose_to_fp8: dtype must be Float8_e4m3fn ",
              "or Float8_e5m2, got ", dtype);
  TORCH_CHECK(dispatch_amax_dtype(src.scalar_type(), [](auto) {}), "cast_transpose_to_fp8: src has dtype ",
              src.scalar_type(), "; supported: Float, BFloat16, Half, Double");
  TORCH_CHECK(src.dim() == 2, "cast_transpose_to_fp8: src must be 2-D [M, K], got shape ", src.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"scale", &scale}, {"out", &out},
                                {"out_t", &out_t}, {"amax", &amax}}) {
    TORCH_CHECK(t->device() == src.device(), "cast_transpose_to_fp8: ", name, " is on ", t->device(),
                " but src is on ", src.device());
  }
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "cast_transpose_to_fp8: scale must be a ",
              "one-element Float tensor, got ", scale.scalar_type(), " with ", scale.numel(), " elements");
  TORCH_CHECK(amax.scalar_type() == at::kFloat && amax.numel() == 1, "cast_transpose_to_fp8: amax must be a ",
              "one-element Float tensor, got ", amax.scalar_type(), " with ", amax.numel(), " elements");
  const int64_t m = src.size(0), k = src.size(1);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 && out.size(0) == m &&
                  out.size(1) == k,
              "cast_transpose_to_fp8: out must be a contiguous Byte tensor of src's shape ", src.sizes(), ", got ",
              out.scalar_type(), " of shape ", out.sizes(), out.is_contiguous() ? "" : ", not contiguous");
  TORCH_CHECK(out_t.scalar_type() == at::kByte && out_t.is_contiguous() && out_t.dim() == 2 && out_t.size(0) == k &&
                  out_t.size(1) >= m,
              "cast_transpose_to_fp8: out_t must be a contiguous Byte tensor [K, Mt] with K = ", k, " and Mt >= M = ",
              m, ", got ", out_t.scalar_type(), " of shape ", out_t.sizes(),
              out_t.is_contiguous() ? "" : ", not contiguous");
}

void cast_transpose_to_fp8_cpu(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                               const at::Tensor& out, const at::Tensor& out_t, const at::Tensor& amax) {
  check_cast_transpose_to_fp8_args(src, scale, dtype, out, out_t, amax);
  const int64_t m = src.size(0), k = src.size(1), mt = out_t.size(1);
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  const float scale_value = *static_cast<const float*>(scale.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  uint8_t* dst_t = static_cast<uint8_t*>(out_t.data_ptr());
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  std::vector<uint32_t> block_amax(static_cast<size_t>(row_blocks), 0);  // float32 bits, per row block
  dispatch_amax_dtype(src.scalar_type(), [&](auto src_tag) {
    using S = typename decltype(src_tag)::type;
    using Bits = typename AmaxTraits<S>::Bits;
    const S* in = static_cast<const S*>(src.data_ptr());
    dispatch_fp8_dtype(dtype, [&](auto fp8_tag, float max) {
      using F8 = typename decltype(fp8_tag)::type;
      at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t block = begin; block < end; ++block) {
          const int64_t i0 = block * kRows, i1 = std::min(m, i0 + kRows);
          Bits bits = 0;
          for (int64_t j0 = 0; j0 < k; j0 += kCols) {
            const int64_t width = std::min(k, j0 + kCols) - j0;
            for (int64_t i = i0; i < i1; ++i) {
              uint8_t* o = dst + i * k + j0;
              const S* row = in + i * s0 + j0 * s1;
              bits = std::max(bits, s1 == 1 ? cast_row<S, F8, true>(row, 1, o, width, scale_value, max)
                                            : cast_row<S, F8, false>(row, s1, o, width, scale_value, max));
            }
            // The tile just written is in cache: its transpose, in runs of up to kRows bytes.
            for (int64_t j = j0; j < j0 + width; ++j) {
              uint8_t* t = dst_t + j * mt;
              for (int64_t i = i0; i < i1; ++i) t[i] = dst[i * k + j];
            }
          }
          block_amax[static_cast<size_t>(block)] = AmaxTraits<S>::float_bits(bits);
        }
      });
    });
  });
  if (mt > m) {
    for (int64_t j = 0; j < k; ++j) std::memset(dst_t + j * mt + m, 0, static_cast<size_t>(mt - m));
  }
  const uint32_t bits = block_amax.empty() ? 0u : *std::max_element(block_amax.begin(), block_amax.end());
  std::memcpy(amax.data_ptr(), &bits, sizeof(bits));
}

}  // namespace megatron_fsdp
