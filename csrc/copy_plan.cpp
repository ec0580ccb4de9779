// Builds the device kernels' copy plans (copy_plan.h) and runs them on the
// host for tests: the CUDA kernels' logic, checked where there is no GPU.

#include "copy_plan.h"

#include "copy_kernels.h"

#include <cstdint>

namespace megatron_fsdp {
namespace {

bool copy_kind(at::ScalarType from, at::ScalarType to, CopyKind* kind) {
  using ST = at::ScalarType;
  if (from == to) {
    switch (c10::elementSize(from)) {
      case 1: *kind = CopyKind::kBits8; return true;
      case 2: *kind = CopyKind::kBits16; return true;
      case 4: *kind = CopyKind::kBits32; return true;
      case 8: *kind = CopyKind::kBits64; return true;
      default: return false;
    }
  }
  if (from == ST::Float && to == ST::BFloat16) *kind = CopyKind::kFloatToBFloat16;
  else if (from == ST::Float && to == ST::Half) *kind = CopyKind::kFloatToHalf;
  else if (from == ST::BFloat16 && to == ST::Float) *kind = CopyKind::kBFloat16ToFloat;
  else if (from == ST::Half && to == ST::Float) *kind = CopyKind::kHalfToFloat;
  else return false;
  return true;
}

// Elements to skip before src and dst are both aligned to whole vectors;
// -1 when they never are together (then every access is scalar).
template <typename S, typename D>
int64_t vector_head(const void* src, const void* dst) {
  constexpr int V = VecWidth<S, D>::value;
  const auto s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  if (s % sizeof(S) != 0 || d % sizeof(D) != 0) return -1;
  constexpr uintptr_t src_align = V * sizeof(S), dst_align = V * sizeof(D);
  const int64_t head = static_cast<int64_t>(((src_align - s % src_align) % src_align) / sizeof(S));
  return (d + head * sizeof(D)) % dst_align == 0 ? head : -1;
}

}  // namespace

void CopyPlan::add(const void* src, at::ScalarType src_type, void* dst, at::ScalarType dst_type, int64_t n_copy,
                   int64_t n_zero) {
  const int64_t total = n_copy + n_zero;
  if (total == 0) return;
  CopyKind kind;
  TORCH_CHECK(copy_kind(src_type, dst_type, &kind), "copy plan: no kernel for ", src_type, " -> ", dst_type);
  CopyGroup* group = nullptr;
  for (CopyGroup& g : groups) {
    if (g.kind == kind) group = &g;
  }
  if (group == nullptr) {
    groups.push_back(CopyGroup{kind, {}, {0}});
    group = &groups.back();
  }
  dispatch_copy_kind(kind, [&](auto s, auto d) {
    using S = typename decltype(s)::type;
    using D = typename decltype(d)::type;
    group->segments.push_back(CopySegment{src, dst, n_copy, n_zero, vector_head<S, D>(src, dst)});
    const int64_t tiles = (total + tile_elems<S, D>() - 1) / tile_elems<S, D>();
    group->first_tile.push_back(group->first_tile.back() + tiles);
  });
}

void CopyPlan::add_tensor_copy(const at::Tensor& dst_view, const at::Tensor& src, int64_t n_zero) {
  CopyKind kind;
  const int64_t n = src.numel();
  if (src.is_contiguous() && copy_kind(src.scalar_type(), dst_view.scalar_type(), &kind)) {
    add(src.data_ptr(), src.scalar_type(), dst_view.data_ptr(), dst_view.scalar_type(), n, n_zero);
    return;
  }
  if (n > 0) aten_copies.emplace_back(dst_view.narrow(0, 0, n), src.reshape(-1));
  if (n_zero > 0) aten_zeros.push_back(dst_view.narrow(0, n, n_zero));
}

CopyPlan plan_pack_into(at::TensorList inputs, const at::Tensor& out) {
  const std::vector<int64_t> offsets = check_pack_args(inputs, out);
  CopyPlan plan;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].numel() > 0) plan.add_tensor_copy(out.narrow(0, offsets[i], inputs[i].numel()), inputs[i]);
  }
  return plan;
}

CopyPlan plan_split_copy_out(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
  const std::vector<int64_t> offsets = check_split_copy_out_args(src, split_sizes, out);
  CopyPlan plan;
  const int64_t world = src.size(0);
  for (size_t i = 0; i < out.size(); ++i) {
    if (split_sizes[i] == 0) continue;
    for (int64_t r = 0; r < world; ++r) {
      const at::Tensor row = src.select(0, r).narrow(0, offsets[i], split_sizes[i]);
      const at::Tensor dst = out[i].select(0, r);
      if (dst.is_contiguous()) plan.add_tensor_copy(dst, row);
      else plan.aten_copies.emplace_back(dst, row);
    }
  }
  return plan;
}

CopyPlan plan_chunk_cat(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  const ChunkCatLayout layout = check_chunk_cat_args(tensors, num_chunks, out);
  CopyPlan plan;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t chunk_numel = layout.chunk_numel(i);
    if (chunk_numel == 0) continue;
    for (int64_t r = 0; r < num_chunks; ++r) {
      const int64_t valid = layout.valid(i, r);
      const at::Tensor rows = tensors[i].narrow(0, layout.first_row(i, r), valid / std::max<int64_t>(layout.inner[i], 1));
      plan.add_tensor_copy(out.select(0, r).narrow(0, layout.col_offset[i], chunk_numel), rows, chunk_numel - valid);
    }
  }
  return plan;
}

namespace {

// Every block of every launch, one after another, each thread in turn: a
// legal schedule of the device kernel, whose threads never share an element.
void run_plan_on_host(const CopyPlan& plan) {
  for (const CopyGroup& group : plan.groups) {
    const int64_t n = static_cast<int64_t>(group.segments.size());
    const int64_t tiles = group.first_tile.back();
    dispatch_copy_kind(group.kind, [&](auto s, auto d) {
      using S = typename decltype(s)::type;
      using D = typename decltype(d)::type;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t seg = find_segment(group.first_tile.data(), n, tile);
        for (int thread = 0; thread < kCopyThreads; ++thread) {
          copy_tile<S, D>(group.segments[seg], tile - group.first_tile[seg], thread, kCopyThreads);
        }
      }
    });
  }
  for (const auto& copy : plan.aten_copies) copy.first.copy_(copy.second);
  for (const at::Tensor& zeros : plan.aten_zeros) zeros.zero_();
}

void require_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, "_emulated runs the device plan on CPU tensors, got ", t.device());
}

}  // namespace

void pack_into_emulated(at::TensorList inputs, const at::Tensor& out) {
  require_cpu(out, "pack_into");
  run_plan_on_host(plan_pack_into(inputs, out));
}

void split_copy_out_emulated(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
  require_cpu(src, "split_copy_out");
  run_plan_on_host(plan_split_copy_out(src, split_sizes, out));
}

void chunk_cat_emulated(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  require_cpu(out, "chunk_cat");
  run_plan_on_host(plan_chunk_cat(tensors, num_chunks, out));
}

}  // namespace megatron_fsdp
