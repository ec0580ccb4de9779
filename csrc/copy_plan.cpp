// Builds the device kernels' copy plans (copy_plan.h) and runs them on the
// host for tests: the CUDA kernels' logic, checked where there is no GPU.

#include "copy_plan.h"

#include "copy_kernels.h"
#include "copy_plan_cache.h"

#include <cstdint>
#include <functional>
#include <limits>

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

}  // namespace

bool CopyPlan::add(const void* src, at::ScalarType src_type, void* dst, at::ScalarType dst_type, int64_t n_copy,
                   int64_t n_zero, int64_t rows, int64_t src_row_stride, int64_t dst_row_stride) {
  CopyKind kind;
  if (!use_kernel || !copy_kind(src_type, dst_type, &kind)) return false;
  const int64_t total = n_copy + n_zero;
  if (total == 0 || rows == 0) return true;
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
    const int64_t tiles_per_row = (total + tile_elems<S, D>() - 1) / tile_elems<S, D>();
    group->segments.push_back(
        CopySegment{src, dst, n_copy, n_zero, rows, src_row_stride, dst_row_stride, tiles_per_row});
    group->first_tile.push_back(group->first_tile.back() + rows * tiles_per_row);
  });
  // One launch per group, one block per tile: checked while planning, before any launch.
  TORCH_CHECK(group->first_tile.back() <= std::numeric_limits<int32_t>::max(), "copy kernels: ",
              group->first_tile.back(), " tiles of one dtype pair exceed a CUDA grid; split the call");
  return true;
}

void CopyPlan::add_aten_copy(const at::Tensor& dst_view, const at::Tensor& src, int64_t n_zero) {
  const int64_t n = src.numel();
  if (n > 0) aten_copies.emplace_back(dst_view.narrow(0, 0, n), src.reshape(-1));
  if (n_zero > 0) aten_zeros.push_back(dst_view.narrow(0, n, n_zero));
}

void CopyPlan::run_aten_copies() const {
  for (const auto& copy : aten_copies) copy.first.copy_(copy.second);
  for (const at::Tensor& zeros : aten_zeros) zeros.zero_();
}

namespace {

char* byte_ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

// The common cases (contiguous, a dtype pair the kernels take) are planned
// from raw pointers: a tensor view per piece would cost more host time than
// the copy itself for thousands of small tensors.

CopyPlan plan_pack_into(at::TensorList inputs, const at::Tensor& out, bool use_kernel) {
  const std::vector<int64_t> offsets = check_pack_args(inputs, out);
  CopyPlan plan;
  plan.use_kernel = use_kernel;
  const int64_t item = out.element_size();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const int64_t n = t.numel();
    if (n == 0) continue;
    if (!(is_plain(t) &&
          plan.add(t.data_ptr(), t.scalar_type(), byte_ptr(out) + offsets[i] * item, out.scalar_type(), n, 0))) {
      plan.add_aten_copy(out.narrow(0, offsets[i], n), t);
    }
  }
  return plan;
}

CopyPlan plan_split_copy_out(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out,
                             bool use_kernel) {
  const std::vector<int64_t> offsets = check_split_copy_out_args(src, split_sizes, out);
  CopyPlan plan;
  plan.use_kernel = use_kernel;
  const int64_t world = src.size(0), total = src.size(1), item = src.element_size();
  const bool raw_src = is_plain(src);
  for (size_t i = 0; i < out.size(); ++i) {
    const at::Tensor& o = out[i];
    const int64_t len = split_sizes[i];
    if (len == 0) continue;
    // One segment per output: its `world` rows, src rows `total` apart.
    if (!(raw_src && o.stride(1) == 1 && plan.add(byte_ptr(src) + offsets[i] * item, src.scalar_type(),
                                                  o.data_ptr(), o.scalar_type(), len, 0, world, total,
                                                  o.stride(0)))) {
      plan.aten_copies.emplace_back(o, src.narrow(1, offsets[i], len));
    }
  }
  return plan;
}

CopyPlan plan_chunk_cat(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out, bool use_kernel) {
  const ChunkCatLayout layout = check_chunk_cat_args(tensors, num_chunks, out);
  CopyPlan plan;
  plan.use_kernel = use_kernel;
  const int64_t item = out.element_size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t chunk_numel = layout.chunk_numel(i);
    if (chunk_numel == 0) continue;
    for (int64_t r = 0; r < num_chunks; ++r) {
      const int64_t valid = layout.valid(i, r);
      const int64_t first_row = layout.first_row(i, r);
      char* dst = byte_ptr(out) + (r * layout.row_numel + layout.col_offset[i]) * item;
      if (is_plain(t) && plan.add(byte_ptr(t) + first_row * layout.inner[i] * t.element_size(), t.scalar_type(),
                                  dst, out.scalar_type(), valid, chunk_numel - valid)) {
        continue;
      }
      plan.add_aten_copy(out.select(0, r).narrow(0, layout.col_offset[i], chunk_numel),
                         t.narrow(0, first_row, valid / layout.inner[i]), chunk_numel - valid);
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
  plan.run_aten_copies();
}

void require_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, "_emulated runs the device plan on CPU tensors, got ", t.device());
}

// The emulated ops keep their plans as the CUDA ops do (copy_plan_cache.h),
// so that CI tests the keys and the reuse.
void run_cached_on_host(PlanKey key, const std::function<CopyPlan()>& make_plan) {
  PlanCache<CopyPlan>& cache = emulated_plan_cache();
  if (const std::shared_ptr<const CopyPlan> plan = cache.find(key)) {
    run_plan_on_host(*plan);
    return;
  }
  auto plan = std::make_shared<const CopyPlan>(make_plan());
  run_plan_on_host(*plan);
  if (cacheable(*plan)) cache.insert(std::move(key), std::move(plan));
}

}  // namespace

PlanCache<CopyPlan>& emulated_plan_cache() {
  static PlanCache<CopyPlan> cache(kPlanCacheCapacity);
  return cache;
}

std::vector<std::pair<std::string, PlanCacheStats>> copy_plan_cache_stats() {
  std::vector<std::pair<std::string, PlanCacheStats>> stats{{"emulated", emulated_plan_cache().stats()}};
#ifdef MEGATRON_FSDP_WITH_CUDA
  stats.emplace_back("cuda", cuda_plan_cache_stats());
#endif
  return stats;
}

void clear_copy_plan_caches() {
  emulated_plan_cache().clear();
#ifdef MEGATRON_FSDP_WITH_CUDA
  clear_cuda_plan_cache();
#endif
}

void pack_into_emulated(at::TensorList inputs, const at::Tensor& out) {
  require_cpu(out, "pack_into");
  run_cached_on_host(pack_into_key(inputs, out), [&] { return plan_pack_into(inputs, out); });
}

void split_copy_out_emulated(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
  require_cpu(src, "split_copy_out");
  run_cached_on_host(split_copy_out_key(src, split_sizes, out),
                     [&] { return plan_split_copy_out(src, split_sizes, out); });
}

void chunk_cat_emulated(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  require_cpu(out, "chunk_cat");
  run_cached_on_host(chunk_cat_key(tensors, num_chunks, out), [&] { return plan_chunk_cat(tensors, num_chunks, out); });
}

}  // namespace megatron_fsdp
