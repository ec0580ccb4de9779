// CPU kernels for fp8 training, the device plan of the multi-tensor amax
// (shared with fp8_kernels_cuda.cu) and its host emulation.
//
// multi_tensor_amax: every tensor is cut into pieces of at most kPiece
// elements; pieces, small tensors whole, are grouped into batches of about
// equal work, and the batches are the items of ONE parallel region. So 200
// small weights cost one parallel region, not 200 reductions, and a few
// large ones still spread over all threads.

#include "fp8_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>

namespace megatron_fsdp {
namespace {

constexpr int64_t kPiece = 1 << 16;  // elements
// Per-piece bookkeeping counted as this many elements of work when batching.
constexpr int64_t kPieceOverhead = 256;

// The inner loops: an integer max over sign-cleared bits, which compilers
// vectorize; with GCC on x86-64 Linux an AVX2 clone is picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define MFSDP_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MFSDP_CLONES
#endif

MFSDP_CLONES uint16_t max_abs_bits16(const uint16_t* p, int64_t n) {
  uint16_t m = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint16_t v = p[k] & 0x7fffu;
    m = v > m ? v : m;
  }
  return m;
}

MFSDP_CLONES uint32_t max_abs_bits32(const uint32_t* p, int64_t n) {
  uint32_t m = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t v = p[k] & 0x7fffffffu;
    m = v > m ? v : m;
  }
  return m;
}

MFSDP_CLONES uint64_t max_abs_bits64(const uint64_t* p, int64_t n) {
  uint64_t m = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint64_t v = p[k] & 0x7fffffffffffffffull;
    m = v > m ? v : m;
  }
  return m;
}

// float32 bits of max |x| over n elements of type T at data.
template <typename T>
uint32_t piece_amax(const void* data, int64_t n) {
  using Bits = typename AmaxTraits<T>::Bits;
  Bits m;
  if constexpr (sizeof(Bits) == 2) m = max_abs_bits16(static_cast<const uint16_t*>(data), n);
  else if constexpr (sizeof(Bits) == 4) m = max_abs_bits32(static_cast<const uint32_t*>(data), n);
  else m = max_abs_bits64(static_cast<const uint64_t*>(data), n);
  return AmaxTraits<T>::float_bits(m);
}

// A loop of its own, with restrict pointers and values: inside the lambda
// the byte stores could alias the captured variables, and it would not vectorize.
template <typename S, typename F8>
void cast_span(const S* __restrict in, uint8_t* __restrict out, int64_t n, float scale, float max) {
  for (int64_t k = 0; k < n; ++k) out[k] = scaled_fp8_bits<S, F8>(in[k], scale, max);
}

struct Piece {
  const void* data;
  int64_t numel;
  int64_t tensor;
  uint32_t (*amax)(const void*, int64_t);
};

at::Tensor float_bits_to_tensor(const std::vector<uint32_t>& bits, const at::Device& device) {
  at::Tensor out = at::empty({static_cast<int64_t>(bits.size())}, at::TensorOptions().dtype(at::kFloat));
  if (!bits.empty()) std::memcpy(out.data_ptr(), bits.data(), bits.size() * sizeof(uint32_t));
  return device.is_cpu() ? out : out.to(device);
}

}  // namespace

void check_amax_args(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == tensors[0].device(), "multi_tensor_amax: tensors[", i, "] is on ", t.device(),
                " but tensors[0] is on ", tensors[0].device());
    TORCH_CHECK(dispatch_amax_dtype(t.scalar_type(), [](auto) {}), "multi_tensor_amax: tensors[", i, "] has dtype ",
                t.scalar_type(), "; supported: Float, BFloat16, Half, Double");
  }
}

at::Tensor multi_tensor_amax_cpu(at::TensorList tensors) {
  check_amax_args(tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<at::Tensor> contiguous;  // copies of strided inputs, alive until the pass ran
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* t = &tensors[i];
    const int64_t numel = t->numel();
    if (numel == 0) continue;
    if (!t->is_contiguous()) {
      contiguous.push_back(t->contiguous());
      t = &contiguous.back();
    }
    uint32_t (*amax)(const void*, int64_t) = nullptr;
    dispatch_amax_dtype(t->scalar_type(), [&](auto tag) { amax = &piece_amax<typename decltype(tag)::type>; });
    const char* base = static_cast<const char*>(t->data_ptr());
    for (int64_t offset = 0; offset < numel; offset += kPiece) {
      pieces.push_back({base + offset * t->element_size(), std::min(kPiece, numel - offset), i, amax});
    }
    total += numel;
  }
  // Batches of about equal work, at least four per thread when there is enough of it.
  const int64_t target = std::max<int64_t>(kPiece, total / (4 * at::get_num_threads()));
  std::vector<size_t> starts = {0};
  int64_t work = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    work += pieces[p].numel + kPieceOverhead;
    if (work >= target) {
      starts.push_back(p + 1);
      work = 0;
    }
  }
  if (starts.back() != pieces.size()) starts.push_back(pieces.size());
  std::vector<uint32_t> piece_bits(pieces.size());
  at::parallel_for(0, static_cast<int64_t>(starts.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (size_t p = starts[b]; p < starts[b + 1]; ++p) piece_bits[p] = pieces[p].amax(pieces[p].data, pieces[p].numel);
    }
  });
  std::vector<uint32_t> bits(n, 0);
  for (size_t p = 0; p < pieces.size(); ++p) bits[pieces[p].tensor] = std::max(bits[pieces[p].tensor], piece_bits[p]);
  return float_bits_to_tensor(bits, at::kCPU);
}

at::Tensor multi_tensor_amax_meta(at::TensorList tensors) {
  check_amax_args(tensors);
  return at::empty({static_cast<int64_t>(tensors.size())},
                   at::TensorOptions().dtype(at::kFloat).device(tensors.empty() ? at::kMeta : tensors[0].device()));
}

AmaxPlan plan_multi_tensor_amax(at::TensorList tensors) {
  check_amax_args(tensors);
  AmaxPlan plan;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor* t = &tensors[i];
    if (t->numel() == 0) continue;  // its output stays 0
    if (!t->is_contiguous()) {
      plan.contiguous.push_back(t->contiguous());
      t = &plan.contiguous.back();
    }
    auto group = std::find_if(plan.groups.begin(), plan.groups.end(),
                              [&](const AmaxGroup& g) { return g.dtype == t->scalar_type(); });
    if (group == plan.groups.end()) {
      plan.groups.push_back({t->scalar_type(), {}, {0}});
      group = plan.groups.end() - 1;
    }
    int64_t tile_elems = 0;
    dispatch_amax_dtype(t->scalar_type(), [&](auto tag) { tile_elems = amax_tile_elems<typename decltype(tag)::type>(); });
    group->segments.push_back({t->data_ptr(), t->numel(), static_cast<int64_t>(i)});
    group->first_tile.push_back(group->first_tile.back() + (t->numel() + tile_elems - 1) / tile_elems);
  }
  return plan;
}

at::Tensor multi_tensor_amax_emulated(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device().is_cpu(), "multi_tensor_amax_emulated runs the device plan on CPU tensors, got ",
                tensors[i].device());
  }
  const AmaxPlan plan = plan_multi_tensor_amax(tensors);
  std::vector<uint32_t> bits(tensors.size(), 0);
  for (const AmaxGroup& group : plan.groups) {
    dispatch_amax_dtype(group.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const int64_t n = static_cast<int64_t>(group.segments.size());
      for (int64_t tile = 0; tile < group.first_tile.back(); ++tile) {  // one block each
        const int64_t s = find_segment(group.first_tile.data(), n, tile);
        const AmaxSegment& seg = group.segments[s];
        uint32_t block_max = 0;
        for (int thread = 0; thread < kAmaxThreads; ++thread) {
          block_max = std::max(block_max, amax_tile<T>(seg, tile - group.first_tile[s], thread, kAmaxThreads));
        }
        bits[seg.out_index] = std::max(bits[seg.out_index], block_max);  // the kernel's atomicMax
      }
    });
  }
  return float_bits_to_tensor(bits, at::kCPU);
}

void check_cast_to_fp8_args(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype,
                            const at::Tensor& out) {
  TORCH_CHECK(dispatch_fp8_dtype(dtype, [](auto, float) {}), "cast_to_fp8: dtype must be Float8_e4m3fn or ",
              "Float8_e5m2, got ", dtype);
  TORCH_CHECK(dispatch_amax_dtype(src.scalar_type(), [](auto) {}), "cast_to_fp8: src has dtype ", src.scalar_type(),
              "; supported: Float, BFloat16, Half, Double");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1,
              "cast_to_fp8: scale must be a one-element Float tensor, got ", scale.scalar_type(), " with ",
              scale.numel(), " elements");
  TORCH_CHECK(scale.device() == src.device(), "cast_to_fp8: scale is on ", scale.device(), " but src is on ",
              src.device());
  TORCH_CHECK(out.device() == src.device(), "cast_to_fp8: out is on ", out.device(), " but src is on ",
              src.device());
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == src.numel(),
              "cast_to_fp8: out must be a contiguous Byte tensor of ", src.numel(), " elements (src's), got ",
              out.scalar_type(), " of shape ", out.sizes(), out.is_contiguous() ? "" : ", not contiguous");
}

void cast_to_fp8_cpu(const at::Tensor& src, const at::Tensor& scale, at::ScalarType dtype, const at::Tensor& out) {
  check_cast_to_fp8_args(src, scale, dtype, out);
  const at::Tensor s = src.contiguous();
  const float scale_value = *static_cast<const float*>(scale.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  dispatch_amax_dtype(s.scalar_type(), [&](auto src_tag) {
    using S = typename decltype(src_tag)::type;
    const S* in = static_cast<const S*>(s.data_ptr());
    dispatch_fp8_dtype(dtype, [&](auto fp8_tag, float max) {
      using F8 = typename decltype(fp8_tag)::type;
      at::parallel_for(0, s.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
        cast_span<S, F8>(in + begin, dst + begin, end - begin, scale_value, max);
      });
    });
  });
}

}  // namespace megatron_fsdp
