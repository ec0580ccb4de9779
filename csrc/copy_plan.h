// The device kernels' work list: every copy of an op as contiguous segments,
// grouped by (source dtype, destination dtype) so that each group is one
// kernel launch, whatever the number of tensors.
//
// A segment is one run of elements, or the same run in each of several rows
// (copy-out: one segment per parameter, not per rank). Each row is split into
// fixed-size tiles; a thread block moves one tile, with 16-byte vector
// accesses where the row's source and destination can be aligned together and
// element accesses elsewhere. copy_tile() is compiled
// for the device by nvcc and for the host by the C++ compiler, which runs the
// same plan thread by thread to test it without a GPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#define MFSDP_HOST_DEVICE __host__ __device__
#else
#define MFSDP_HOST_DEVICE
#endif

namespace megatron_fsdp {

struct CopySegment {
  const void* src;
  void* dst;
  int64_t n_copy;          // elements read from src and written (cast) to dst, per row
  int64_t n_zero;          // zeros written after them (chunk_cat's padding), per row
  int64_t rows;            // rows of the segment, at the strides below (elements)
  int64_t src_row_stride;
  int64_t dst_row_stride;
  int64_t tiles_per_row;
};

// What a group's elements are moved as: same-size copies move bits (exact for
// every dtype), casts are those mixed precision makes.
enum class CopyKind { kBits8, kBits16, kBits32, kBits64, kFloatToBFloat16, kFloatToHalf, kBFloat16ToFloat,
                      kHalfToFloat };

struct CopyGroup {
  CopyKind kind;
  std::vector<CopySegment> segments;
  std::vector<int64_t> first_tile;  // per segment, plus the total at the end
};

struct CopyPlan {
  // false: every copy goes to ATen (e.g. while a CUDA graph is captured).
  bool use_kernel = true;
  std::vector<CopyGroup> groups;
  // Copies the kernels do not take (strided sources, rare casts), run with
  // ATen's copy_: (destination view, source), and padding to zero next to them.
  std::vector<std::pair<at::Tensor, at::Tensor>> aten_copies;
  std::vector<at::Tensor> aten_zeros;

  // Adds, for each of `rows` rows, dst[0:n_copy] = cast(src[0:n_copy]), then
  // n_zero zeros; row k starts k * row stride elements on. Returns false,
  // adding nothing, when the kernels do not take this dtype pair.
  bool add(const void* src, at::ScalarType src_type, void* dst, at::ScalarType dst_type, int64_t n_copy,
           int64_t n_zero, int64_t rows = 1, int64_t src_row_stride = 0, int64_t dst_row_stride = 0);
  // Adds a copy, through the kernel when the kernel can take it.
  void add_tensor_copy(const at::Tensor& dst_view, const at::Tensor& src, int64_t n_zero = 0);
};

// Plans of the three ops (arguments checked first: see copy_kernels.h).
CopyPlan plan_pack_into(at::TensorList inputs, const at::Tensor& out, bool use_kernel = true);
CopyPlan plan_split_copy_out(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out,
                             bool use_kernel = true);
CopyPlan plan_chunk_cat(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out, bool use_kernel = true);

// ---- the per-tile copy, shared by the device and the host emulation ----

constexpr int kCopyThreads = 256;  // threads per block
constexpr int kVecBytes = 16;
constexpr int kVecsPerThread = 4;  // per tile

template <typename S, typename D>
struct VecWidth {
  static constexpr int value = kVecBytes / static_cast<int>(sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
};

template <typename S, typename D>
constexpr int64_t tile_elems() {
  return static_cast<int64_t>(kCopyThreads) * kVecsPerThread * VecWidth<S, D>::value;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename S, typename D>
MFSDP_HOST_DEVICE inline D convert(S x) {
  if constexpr (std::is_same<S, D>::value) {
    return x;
  } else {
    // c10's float conversions: the ones torch's copy kernels use, so bits match.
    return static_cast<D>(static_cast<float>(x));
  }
}

// The segment that holds `tile`: the last one whose first tile is <= tile.
MFSDP_HOST_DEVICE inline int64_t find_segment(const int64_t* first_tile, int64_t n_segments, int64_t tile) {
  int64_t lo = 0, hi = n_segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_tile[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Elements to skip before src and dst are both aligned to whole vectors;
// -1 when they never are together (then every access is scalar).
template <typename S, typename D>
MFSDP_HOST_DEVICE inline int64_t vector_head(const S* src, const D* dst) {
  constexpr int V = VecWidth<S, D>::value;
  constexpr uint64_t src_align = V * sizeof(S), dst_align = V * sizeof(D);
  const auto s = reinterpret_cast<uint64_t>(src), d = reinterpret_cast<uint64_t>(dst);
  if (s % sizeof(S) != 0 || d % sizeof(D) != 0) return -1;
  const int64_t head = static_cast<int64_t>(((src_align - s % src_align) % src_align) / sizeof(S));
  return (d + head * sizeof(D)) % dst_align == 0 ? head : -1;
}

// Thread `thread` of `threads` moves its share of tile `tile` of `seg`.
template <typename S, typename D>
MFSDP_HOST_DEVICE void copy_tile(const CopySegment& seg, int64_t tile, int thread, int threads) {
  constexpr int V = VecWidth<S, D>::value;
  constexpr int64_t T = tile_elems<S, D>();
  const int64_t row = tile / seg.tiles_per_row;
  const S* src = static_cast<const S*>(seg.src) + row * seg.src_row_stride;
  D* dst = static_cast<D*>(seg.dst) + row * seg.dst_row_stride;
  const int64_t n_copy = seg.n_copy;
  const int64_t total = n_copy + seg.n_zero;
  const int64_t begin = (tile - row * seg.tiles_per_row) * T;
  const int64_t end = begin + T < total ? begin + T : total;
  auto scalar = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo + thread; k < hi; k += threads) dst[k] = k < n_copy ? convert<S, D>(src[k]) : D(0);
  };
  const int64_t head = vector_head(src, dst);
  if (head < 0) {
    scalar(begin, end);
    return;
  }
  // Tiles start at multiples of T (itself a multiple of V), so the aligned
  // vectors of every tile start `head` elements in.
  const int64_t vbegin = begin + head < end ? begin + head : end;
  const int64_t n_vec = (end - vbegin) / V;
  const int64_t vend = vbegin + n_vec * V;
  scalar(begin, vbegin);
  scalar(vend, end);
  for (int64_t j = thread; j < n_vec; j += threads) {
    const int64_t k = vbegin + j * V;
#if !defined(__CUDA_ARCH__)
    // The host tolerates misaligned vectors, the device does not: the emulation checks for it.
    if (reinterpret_cast<uintptr_t>(src + k) % alignof(Vec<S, V>) != 0 ||
        reinterpret_cast<uintptr_t>(dst + k) % alignof(Vec<D, V>) != 0) {
      throw std::logic_error("copy_tile: misaligned vector access");
    }
#endif
    Vec<D, V> out;
    if (k + V <= n_copy) {
      const Vec<S, V> in = *reinterpret_cast<const Vec<S, V>*>(src + k);
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = convert<S, D>(in.v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = k + e < n_copy ? convert<S, D>(src[k + e]) : D(0);
    }
    *reinterpret_cast<Vec<D, V>*>(dst + k) = out;
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<S>{}, TypeTag<D>{}) with the element types of `kind`.
template <typename Fn>
void dispatch_copy_kind(CopyKind kind, Fn&& fn) {
  switch (kind) {
    case CopyKind::kBits8: return fn(TypeTag<uint8_t>{}, TypeTag<uint8_t>{});
    case CopyKind::kBits16: return fn(TypeTag<uint16_t>{}, TypeTag<uint16_t>{});
    case CopyKind::kBits32: return fn(TypeTag<uint32_t>{}, TypeTag<uint32_t>{});
    case CopyKind::kBits64: return fn(TypeTag<uint64_t>{}, TypeTag<uint64_t>{});
    case CopyKind::kFloatToBFloat16: return fn(TypeTag<float>{}, TypeTag<c10::BFloat16>{});
    case CopyKind::kFloatToHalf: return fn(TypeTag<float>{}, TypeTag<c10::Half>{});
    case CopyKind::kBFloat16ToFloat: return fn(TypeTag<c10::BFloat16>{}, TypeTag<float>{});
    case CopyKind::kHalfToFloat: return fn(TypeTag<c10::Half>{}, TypeTag<float>{});
  }
}

}  // namespace megatron_fsdp
