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

// The Tensor class alone: ATen/ATen.h (every operator) would triple the compile time.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#define MFSDP_HOST_DEVICE __host__ __device__
#define MFSDP_UNROLL _Pragma("unroll")
#else
#define MFSDP_HOST_DEVICE
#define MFSDP_UNROLL  // nvcc's pragma; gcc unrolls these constant-count loops at -O3 anyway
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
  // adding nothing, when the kernels do not take this dtype pair or the plan
  // is for ATen only (use_kernel false).
  bool add(const void* src, at::ScalarType src_type, void* dst, at::ScalarType dst_type, int64_t n_copy,
           int64_t n_zero, int64_t rows = 1, int64_t src_row_stride = 0, int64_t dst_row_stride = 0);
  // Adds a copy (and its padding) for ATen's copy_, whatever the kernels take.
  void add_aten_copy(const at::Tensor& dst_view, const at::Tensor& src, int64_t n_zero = 0);
  // Runs aten_copies and aten_zeros: the part of a plan no kernel launch covers.
  void run_aten_copies() const;
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

// A whole vector as 32-bit words: loaded and stored in one 16- or 8-byte
// access. (A vector of 2-byte elements written element by element lets the
// compiler split its store into 2-byte stores.)
template <int Bytes>
struct alignas(Bytes) RawWord {
  uint32_t w[Bytes / 4];
};

template <typename T>
MFSDP_HOST_DEVICE inline T from_bits(uint64_t bits) {
  T value;
  memcpy(&value, &bits, sizeof(T));  // little-endian: the low bytes
  return value;
}

template <typename T>
MFSDP_HOST_DEVICE inline uint64_t to_bits(T value) {
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof(T));
  return bits;
}

// One 16- or 8-byte store. On the device written out in PTX: a value
// assembled word by word is otherwise stored in pieces (seen with nvcc 13).
template <int Bytes>
MFSDP_HOST_DEVICE inline void store_raw(void* p, const RawWord<Bytes>& r) {
#if defined(__CUDA_ARCH__)
  if constexpr (Bytes == 16) {
    asm volatile("st.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r.w[0]), "r"(r.w[1]), "r"(r.w[2]), "r"(r.w[3])
                 : "memory");
  } else {
    asm volatile("st.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(r.w[0]), "r"(r.w[1]) : "memory");
  }
#else
  *reinterpret_cast<RawWord<Bytes>*>(p) = r;
#endif
}

// Element e of a raw word holding elements of type T.
template <typename T, int Bytes>
MFSDP_HOST_DEVICE inline T raw_get(const RawWord<Bytes>& r, int e) {
  constexpr int B = sizeof(T);
  if constexpr (B == 8) {
    return from_bits<T>(static_cast<uint64_t>(r.w[2 * e]) | (static_cast<uint64_t>(r.w[2 * e + 1]) << 32));
  } else {
    const uint32_t word = r.w[(e * B) / 4] >> (8 * ((e * B) % 4));
    return from_bits<T>(B == 4 ? word : word & ((1u << (8 * B)) - 1u));
  }
}

// Sets element e of a zero-initialized raw word.
template <typename T, int Bytes>
MFSDP_HOST_DEVICE inline void raw_set(RawWord<Bytes>& r, int e, T value) {
  constexpr int B = sizeof(T);
  const uint64_t bits = to_bits(value);
  if constexpr (B == 8) {
    r.w[2 * e] = static_cast<uint32_t>(bits);
    r.w[2 * e + 1] = static_cast<uint32_t>(bits >> 32);
  } else {
    r.w[(e * B) / 4] |= static_cast<uint32_t>(bits) << (8 * ((e * B) % 4));
  }
}

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

// The host tolerates misaligned vectors, the device does not: the emulation checks for it.
MFSDP_HOST_DEVICE inline void check_vector_alignment(const void* p, uint64_t align) {
#if !defined(__CUDA_ARCH__)
  if (reinterpret_cast<uint64_t>(p) % align != 0) throw std::logic_error("copy_tile: misaligned vector access");
#else
  (void)p;
  (void)align;
#endif
}

// [lo, hi) split at the vector grid that starts at `head` (mod V): the
// aligned vectors [*first, *first + *count * V) and scalar ends around them.
template <int V>
MFSDP_HOST_DEVICE inline void vector_span(int64_t lo, int64_t hi, int64_t head, int64_t* first, int64_t* count) {
  const int64_t offset = ((head - lo) % V + V) % V;
  *first = lo + offset < hi ? lo + offset : hi;
  *count = (hi - *first) / V;
}

// dst[k] = convert(src[k]) for k in [lo, hi).
template <typename S, typename D>
MFSDP_HOST_DEVICE void copy_span(const S* src, D* dst, int64_t lo, int64_t hi, int thread, int threads) {
  constexpr int V = VecWidth<S, D>::value;
  const int64_t head = vector_head(src, dst);
  int64_t first = hi, count = 0;
  if (head >= 0) vector_span<V>(lo, hi, head, &first, &count);
  const int64_t last = first + count * V;
  for (int64_t k = lo + thread; k < first; k += threads) dst[k] = convert<S, D>(src[k]);
  for (int64_t k = last + thread; k < hi; k += threads) dst[k] = convert<S, D>(src[k]);
  for (int64_t j = thread; j < count; j += threads) {
    const int64_t k = first + j * V;
    check_vector_alignment(src + k, V * sizeof(S));
    check_vector_alignment(dst + k, V * sizeof(D));
    const RawWord<V * sizeof(S)> in = *reinterpret_cast<const RawWord<V * sizeof(S)>*>(src + k);
    if constexpr (std::is_same<S, D>::value) {
      store_raw(dst + k, in);
    } else {
      RawWord<V * sizeof(D)> out = {};
MFSDP_UNROLL
      for (int e = 0; e < V; ++e) raw_set<D>(out, e, convert<S, D>(raw_get<S>(in, e)));
      store_raw(dst + k, out);
    }
  }
}

// dst[k] = 0 for k in [lo, hi): chunk_cat's padding, 16 bytes at a time.
template <typename D>
MFSDP_HOST_DEVICE void zero_span(D* dst, int64_t lo, int64_t hi, int thread, int threads) {
  constexpr int V = kVecBytes / static_cast<int>(sizeof(D));
  const auto d = reinterpret_cast<uint64_t>(dst);
  int64_t first = hi, count = 0;
  if (d % sizeof(D) == 0) {
    vector_span<V>(lo, hi, static_cast<int64_t>(((kVecBytes - d % kVecBytes) % kVecBytes) / sizeof(D)), &first,
                   &count);
  }
  const int64_t last = first + count * V;
  for (int64_t k = lo + thread; k < first; k += threads) dst[k] = D(0);
  for (int64_t k = last + thread; k < hi; k += threads) dst[k] = D(0);
  const RawWord<kVecBytes> zeros = {};  // +0 in every dtype is all zero bits
  for (int64_t j = thread; j < count; j += threads) {
    check_vector_alignment(dst + first + j * V, kVecBytes);
    store_raw(dst + first + j * V, zeros);
  }
}

// Thread `thread` of `threads` moves its share of tile `tile` of `seg`.
template <typename S, typename D>
MFSDP_HOST_DEVICE void copy_tile(const CopySegment& seg, int64_t tile, int thread, int threads) {
  constexpr int64_t T = tile_elems<S, D>();
  const int64_t row = tile / seg.tiles_per_row;
  const S* src = static_cast<const S*>(seg.src) + row * seg.src_row_stride;
  D* dst = static_cast<D*>(seg.dst) + row * seg.dst_row_stride;
  const int64_t total = seg.n_copy + seg.n_zero;
  const int64_t begin = (tile - row * seg.tiles_per_row) * T;
  const int64_t end = begin + T < total ? begin + T : total;
  const int64_t copy_end = end < seg.n_copy ? end : seg.n_copy;
  if (begin < copy_end) copy_span<S, D>(src, dst, begin, copy_end, thread, threads);
  const int64_t zero_begin = begin > seg.n_copy ? begin : seg.n_copy;
  if (zero_begin < end) zero_span<D>(dst, zero_begin, end, thread, threads);
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
