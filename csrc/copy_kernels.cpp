// The CPU kernels of the megatron_fsdp extension, and the argument checks
// every kernel (CPU and CUDA) runs first.
//
// pack_into: many tensors, flattened, back to back into one flat buffer: the
// data movement of FSDP's all-gather copy-in.
// split_copy_out / chunk_cat: FSDP2's copy-out and reduce-scatter copy-in.
//
// torch runs these as one small copy per tensor (and, for chunk_cat, a
// zero-padded temporary for every unevenly sized tensor), so their cost grows
// with the number of tensors. Here every (tensor, rank) piece is one work item
// of a single parallel region, moved with memcpy when dtypes match and the
// memory is contiguous, and every argument is checked before the first write.

#include "copy_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ThreadLocalState.h>

#include <cstring>

namespace megatron_fsdp {

std::vector<int64_t> check_pack_args(at::TensorList inputs, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 1, "pack_into: out must be 1-D, got ", out.dim(), " dimensions");
  TORCH_CHECK(out.is_contiguous(), "pack_into: out must be contiguous");
  TORCH_CHECK(!out.is_conj() && !out.is_neg(), "pack_into: out must not be a conjugate or negative view");
  std::vector<int64_t> offsets;
  offsets.reserve(inputs.size());
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    TORCH_CHECK(t.device() == out.device(), "pack_into: inputs[", i, "] is on ", t.device(),
                " but out is on ", out.device());
    offsets.push_back(total);
    total += t.numel();
  }
  TORCH_CHECK(total <= out.numel(), "pack_into: inputs hold ", total, " elements but out has only ",
              out.numel());
  return offsets;
}

// Pieces at least this large go to ATen's copy after the parallel pass: it
// splits one big copy over all threads, where the pass gives each piece to
// one thread.
constexpr int64_t kLargePiece = 1 << 20;  // elements
// Casts this small use our scalar loop; larger ones ATen's vectorized cast
// (single-threaded inside the pass), whose per-call cost they amortize.
constexpr int64_t kSmallCast = 1 << 12;  // elements

// dst[k] = To(src[k]) for the casts mixed precision makes, with c10's scalar
// conversions: the bits of torch's own copy, except NaN payloads, which
// torch's vectorized CPU cast writes as 0xFFFF where c10 writes 0x7FC0.
template <typename From, typename To>
static void cast_copy(const void* src, void* dst, int64_t n) {
  const From* s = static_cast<const From*>(src);
  To* d = static_cast<To*>(dst);
  for (int64_t k = 0; k < n; ++k) d[k] = static_cast<To>(static_cast<float>(s[k]));
}

// Copies n contiguous elements with a cast when (from, to) is a mixed-precision
// pair; returns false for any other pair (the caller then uses ATen's copy).
static bool fast_cast_copy(at::ScalarType from, at::ScalarType to, const void* src, void* dst, int64_t n) {
  using ST = at::ScalarType;
  if (from == ST::Float && to == ST::BFloat16) cast_copy<float, c10::BFloat16>(src, dst, n);
  else if (from == ST::Float && to == ST::Half) cast_copy<float, c10::Half>(src, dst, n);
  else if (from == ST::BFloat16 && to == ST::Float) cast_copy<c10::BFloat16, float>(src, dst, n);
  else if (from == ST::Half && to == ST::Float) cast_copy<c10::Half, float>(src, dst, n);
  else return false;
  return true;
}

// ATen calls inside a parallel region run on pool threads: they need the
// caller's thread-local state (inference mode, dispatch key exclusions).
template <typename F>
static void parallel_with_caller_state(int64_t n, const F& f) {
  const at::ThreadLocalState state;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    f(begin, end);
  });
}

void pack_into_cpu(at::TensorList inputs, const at::Tensor& out) {
  const std::vector<int64_t> offsets = check_pack_args(inputs, out);
  const int64_t n = static_cast<int64_t>(inputs.size());
  const int64_t item = out.element_size();
  char* base = static_cast<char*>(out.data_ptr());
  // Small tensors are the case this op exists for: the fast path touches
  // only raw pointers (a tensor view alone costs about a microsecond).
  parallel_with_caller_state(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Tensor& t = inputs[i];
      const int64_t numel = t.numel();
      if (numel == 0 || numel >= kLargePiece) continue;
      if (is_plain(t)) {
        if (t.scalar_type() == out.scalar_type()) {
          std::memcpy(base + offsets[i] * item, t.data_ptr(), numel * item);
          continue;
        }
        if (numel < kSmallCast &&
            fast_cast_copy(t.scalar_type(), out.scalar_type(), t.data_ptr(), base + offsets[i] * item, numel)) {
          continue;
        }
      }
      out.narrow(0, offsets[i], numel).copy_(t.reshape(-1));  // strided, or another cast
    }
  });
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = inputs[i].numel();
    if (numel >= kLargePiece) out.narrow(0, offsets[i], numel).copy_(inputs[i].reshape(-1));
  }
}


static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<int64_t> check_split_copy_out_args(const at::Tensor& src, at::IntArrayRef split_sizes,
                                               at::TensorList out) {
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous(), "split_copy_out: src must be a contiguous 2-D tensor, got ",
              src.dim(), " dimensions");
  TORCH_CHECK(out.size() == split_sizes.size(), "split_copy_out: ", out.size(), " outputs for ", split_sizes.size(),
              " split sizes");
  const int64_t world = src.size(0);
  std::vector<int64_t> offsets(out.size());
  int64_t total = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const at::Tensor& o = out[i];
    TORCH_CHECK(o.dim() == 2 && o.size(0) == world && o.size(1) == split_sizes[i], "split_copy_out: out[", i,
                "] has shape ", o.sizes(), ", expected [", world, ", ", split_sizes[i], "]");
    TORCH_CHECK(o.device() == src.device(), "split_copy_out: out[", i, "] is on ", o.device(), " but src is on ",
                src.device());
    TORCH_CHECK(!o.is_conj() && !o.is_neg(), "split_copy_out: out[", i, "] is a conjugate or negative view");
    at::assert_no_internal_overlap(o);
    offsets[i] = total;
    total += split_sizes[i];
  }
  TORCH_CHECK(total == src.size(1), "split_copy_out: split sizes add up to ", total, " but src has ", src.size(1),
              " columns");
  return offsets;
}

// out[i] is [world_size, split_sizes[i]]; src is [world_size, sum(split_sizes)].
void split_copy_out_cpu(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
  const std::vector<int64_t> offsets = check_split_copy_out_args(src, split_sizes, out);
  const int64_t world = src.size(0);
  const int64_t total = src.size(1);
  const int64_t n = static_cast<int64_t>(out.size());
  const int64_t src_item = src.element_size();
  const char* base = static_cast<const char*>(src.data_ptr());
  const bool raw_src = is_plain(src);
  // One work item per output, all its rows: per-tensor overhead once, not per rank.
  parallel_with_caller_state(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Tensor& o = out[i];
      const int64_t len = split_sizes[i];
      if (len == 0 || len >= kLargePiece) continue;
      if (raw_src && o.scalar_type() == src.scalar_type() && o.stride(1) == 1) {
        char* dst = static_cast<char*>(o.data_ptr());
        const int64_t dst_row = o.stride(0) * src_item;
        for (int64_t r = 0; r < world; ++r) {
          std::memcpy(dst + r * dst_row, base + (r * total + offsets[i]) * src_item, len * src_item);
        }
      } else {
        o.copy_(src.narrow(1, offsets[i], len));
      }
    }
  });
  for (int64_t i = 0; i < n; ++i) {
    if (split_sizes[i] >= kLargePiece) out[i].copy_(src.narrow(1, offsets[i], split_sizes[i]));
  }
}

ChunkCatLayout check_chunk_cat_args(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  TORCH_CHECK(num_chunks >= 1, "chunk_cat: num_chunks must be >= 1, got ", num_chunks);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == num_chunks,
              "chunk_cat: out must be a contiguous [num_chunks, n] tensor, got shape ", out.sizes());
  TORCH_CHECK(!out.is_conj() && !out.is_neg(), "chunk_cat: out must not be a conjugate or negative view");
  const int64_t n = static_cast<int64_t>(tensors.size());
  ChunkCatLayout layout;
  layout.col_offset.resize(n);
  layout.chunk_rows.resize(n);
  layout.inner.resize(n);
  layout.rows.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == out.device(), "chunk_cat: tensors[", i, "] is on ", t.device(), " but out is on ",
                out.device());
    TORCH_CHECK(t.dim() >= 1, "chunk_cat: tensors[", i, "] is 0-dimensional");
    layout.rows[i] = t.size(0);
    layout.inner[i] = layout.rows[i] == 0 ? 0 : t.numel() / layout.rows[i];
    layout.chunk_rows[i] = ceil_div(layout.rows[i], num_chunks);
    layout.col_offset[i] = layout.row_numel;
    layout.row_numel += layout.chunk_numel(i);
  }
  TORCH_CHECK(layout.row_numel == out.size(1), "chunk_cat: the padded chunks hold ", layout.row_numel,
              " elements per row but out has ", out.size(1));
  return layout;
}

// Each tensor is split into num_chunks pieces along dim 0 (ceil-sized, the
// last ones zero-padded); row r of out holds piece r of every tensor.
void chunk_cat_cpu(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  const ChunkCatLayout layout = check_chunk_cat_args(tensors, num_chunks, out);
  const int64_t n = static_cast<int64_t>(tensors.size());
  const int64_t item = out.element_size();
  char* base = static_cast<char*>(out.data_ptr());
  auto aten_copy = [&](int64_t i, int64_t r, int64_t valid) {
    out.select(0, r).narrow(0, layout.col_offset[i], valid).copy_(
        tensors[i].narrow(0, layout.first_row(i, r), valid / layout.inner[i]).reshape(-1));
  };
  parallel_with_caller_state(n * num_chunks, [&](int64_t begin, int64_t end) {
    for (int64_t work = begin; work < end; ++work) {
      const int64_t i = work / num_chunks, r = work % num_chunks;
      const at::Tensor& t = tensors[i];
      const int64_t chunk_numel = layout.chunk_numel(i);
      if (chunk_numel == 0) continue;
      const int64_t valid = layout.valid(i, r);
      char* dst = base + (r * layout.row_numel + layout.col_offset[i]) * item;
      if (valid >= kLargePiece) {
        // copied after the pass; only the padding is written here
      } else if (valid > 0) {
        const int64_t src_offset = layout.first_row(i, r) * layout.inner[i] * t.element_size();
        const char* src = static_cast<const char*>(t.data_ptr()) + src_offset;
        const bool raw = is_plain(t);
        if (raw && t.scalar_type() == out.scalar_type()) {
          std::memcpy(dst, src, valid * item);
        } else if (!(raw && valid < kSmallCast &&
                     fast_cast_copy(t.scalar_type(), out.scalar_type(), src, dst, valid))) {
          aten_copy(i, r, valid);
        }
      }
      if (valid < chunk_numel) std::memset(dst + valid * item, 0, (chunk_numel - valid) * item);
    }
  });
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t r = 0; r < num_chunks; ++r) {
      const int64_t valid = layout.valid(i, r);
      if (valid >= kLargePiece) aten_copy(i, r, valid);
    }
  }
}

}  // namespace megatron_fsdp
