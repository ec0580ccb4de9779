// The device side of the fp8 helper kernels, compiled for the device by nvcc
// and for the host by the C++ compiler (which runs the amax plan block by
// block, thread by thread, to test it without a GPU).
//
// amax works on bits: clearing the sign bit gives |x|, and for every IEEE
// format the non-negative values, +inf and then NaN order like their bit
// patterns read as unsigned integers. So max(|x|) is an integer max (exact,
// NaN-propagating, vectorizable), and the per-tensor results, converted to
// float32 bits, combine with an integer atomicMax.
#pragma once

#include "copy_plan.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace megatron_fsdp {

constexpr int kAmaxThreads = 256;  // threads per block
constexpr int kAmaxVecsPerThread = 8;  // 16-byte loads per thread per tile

template <typename T>
struct AmaxTraits;
template <>
struct AmaxTraits<float> {
  using Bits = uint32_t;
  MFSDP_HOST_DEVICE static uint32_t float_bits(Bits b) { return b; }
};
template <>
struct AmaxTraits<c10::BFloat16> {
  using Bits = uint16_t;
  MFSDP_HOST_DEVICE static uint32_t float_bits(Bits b) { return static_cast<uint32_t>(b) << 16; }
};
template <>
struct AmaxTraits<c10::Half> {
  using Bits = uint16_t;
  MFSDP_HOST_DEVICE static uint32_t float_bits(Bits b) {
    return static_cast<uint32_t>(to_bits(static_cast<float>(from_bits<c10::Half>(b))));
  }
};
template <>
struct AmaxTraits<double> {
  using Bits = uint64_t;
  // Rounding is monotonic: the max of the rounded values is the rounded max.
  MFSDP_HOST_DEVICE static uint32_t float_bits(Bits b) {
    return static_cast<uint32_t>(to_bits(static_cast<float>(from_bits<double>(b))));
  }
};

template <typename Bits>
MFSDP_HOST_DEVICE constexpr Bits abs_mask() {
  return static_cast<Bits>(static_cast<Bits>(~static_cast<Bits>(0)) >> 1);
}

template <typename T>
MFSDP_HOST_DEVICE constexpr int64_t amax_tile_elems() {
  return static_cast<int64_t>(kAmaxThreads) * kAmaxVecsPerThread * (kVecBytes / sizeof(typename AmaxTraits<T>::Bits));
}

// One tensor of a multi-tensor amax: its elements and its output slot.
struct AmaxSegment {
  const void* data;
  int64_t numel;
  int64_t out_index;
};

// Thread `thread` of `threads`: the float32 bits of max |x| over its share
// of tile `tile` of `seg` (0 for no elements).
template <typename T>
MFSDP_HOST_DEVICE uint32_t amax_tile(const AmaxSegment& seg, int64_t tile, int thread, int threads) {
  using Bits = typename AmaxTraits<T>::Bits;
  constexpr int V = kVecBytes / static_cast<int>(sizeof(Bits));
  constexpr Bits mask = abs_mask<Bits>();
  constexpr int64_t TE = amax_tile_elems<T>();
  const Bits* data = static_cast<const Bits*>(seg.data);
  const int64_t lo = tile * TE;
  const int64_t hi = lo + TE < seg.numel ? lo + TE : seg.numel;
  const auto address = reinterpret_cast<uint64_t>(data);
  int64_t first = hi, count = 0;
  if (address % sizeof(Bits) == 0) {
    const auto head = static_cast<int64_t>(((kVecBytes - address % kVecBytes) % kVecBytes) / sizeof(Bits));
    vector_span<V>(lo, hi, head, &first, &count);
  }
  Bits m = 0;
  for (int64_t k = lo + thread; k < first; k += threads) {
    const Bits v = data[k] & mask;
    m = v > m ? v : m;
  }
  for (int64_t k = first + count * V + thread; k < hi; k += threads) {
    const Bits v = data[k] & mask;
    m = v > m ? v : m;
  }
  for (int64_t j = thread; j < count; j += threads) {
    check_vector_alignment(data + first + j * V, kVecBytes);
    const RawWord<kVecBytes> word = *reinterpret_cast<const RawWord<kVecBytes>*>(data + first + j * V);
MFSDP_UNROLL
    for (int e = 0; e < V; ++e) {
      const Bits v = raw_get<Bits>(word, e) & mask;
      m = v > m ? v : m;
    }
  }
  return AmaxTraits<T>::float_bits(m);
}

// |x| as the unsigned bits amax_tile compares (see the top of this file).
template <typename T>
MFSDP_HOST_DEVICE inline typename AmaxTraits<T>::Bits abs_bits(T x) {
  using Bits = typename AmaxTraits<T>::Bits;
  Bits b;
  memcpy(&b, &x, sizeof(b));
  return b & abs_mask<Bits>();
}

// Calls fn(TypeTag<T>{}) for an amax input dtype; false for any other dtype.
template <typename Fn>
bool dispatch_amax_dtype(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(TypeTag<float>{}); return true;
    case at::kBFloat16: fn(TypeTag<c10::BFloat16>{}); return true;
    case at::kHalf: fn(TypeTag<c10::Half>{}); return true;
    case at::kDouble: fn(TypeTag<double>{}); return true;
    default: return false;
  }
}

// ---- scaled cast to fp8 ----

// The fp8 bits of a float, rounded to nearest even: the results of c10's
// conversions (torch's casts), written without branches so that a loop over
// them vectorizes. Every candidate is computed and the valid one selected;
// the others may wrap around, harmlessly.
MFSDP_HOST_DEVICE inline uint32_t float_as_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

MFSDP_HOST_DEVICE inline float bits_as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// E4M3FN: bias 7, 3 mantissa bits, no infinity, NaN 0x7F, largest 448.
MFSDP_HOST_DEVICE inline uint8_t float_to_e4m3fn_bits(float f) {
  const uint32_t bits = float_as_bits(f), sign = bits & 0x80000000u, a = bits ^ sign;
  // Below 2^-6 (the smallest normal): in a + 2^14 the float's last bit is worth 2^-9, the fp8
  // subnormal step, so the addition rounds a to it (ties to even) and leaves the count in the low bits.
  constexpr uint32_t kSubnormalMagic = 141u << 23;
  const uint32_t subnormal = float_as_bits(bits_as_float(a) + bits_as_float(kSubnormalMagic)) - kSubnormalMagic;
  // Rebias the exponent and round the mantissa to 3 bits (ties to even) in one integer add.
  uint32_t normal = (a + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  normal = normal == 0x7Fu ? 0x7Eu : normal;  // rounded up into the NaN pattern: saturate
  uint32_t r = a < (121u << 23) ? subnormal : normal;
  r = a >= (1087u << 20) ? (a > 0x7F800000u ? 0x7Fu : 0x7Eu) : r;  // NaN stays NaN, 480 and above saturate
  return static_cast<uint8_t>(r | (sign >> 24));
}

// E5M2: bias 15, 2 mantissa bits, infinity 0x7C, largest finite 57344.
MFSDP_HOST_DEVICE inline uint8_t float_to_e5m2_bits(float f) {
  const uint32_t bits = float_as_bits(f), sign = bits & 0x80000000u, a = bits ^ sign;
  constexpr uint32_t kSubnormalMagic = 134u << 23;  // 2^7, last bit 2^-16: the subnormal step
  const uint32_t subnormal = float_as_bits(bits_as_float(a) + bits_as_float(kSubnormalMagic)) - kSubnormalMagic;
  const uint32_t normal = (a + (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu + ((a >> 21) & 1u)) >> 21;
  uint32_t r = a < (113u << 23) ? subnormal : normal;
  r = a >= (143u << 23) ? (a > 0x7F800000u ? 0x7Fu : 0x7Cu) : r;  // NaN, or 65536 and above: infinity
  return static_cast<uint8_t>(r | (sign >> 24));
}

// The fp8 bits of clamp(float(x) * scale, -max, max), as torch computes
// `(x.float() * scale).clamp(-max, max).to(F8)`: float32 product, NaN kept.
template <typename S, typename F8>
MFSDP_HOST_DEVICE inline uint8_t scaled_fp8_bits(S x, float scale, float max) {
  float v = static_cast<float>(x) * scale;
  v = v < -max ? -max : (v > max ? max : v);
  if constexpr (std::is_same<F8, c10::Float8_e4m3fn>::value) {
    return float_to_e4m3fn_bits(v);
  } else {
    return float_to_e5m2_bits(v);
  }
}

// Calls fn(TypeTag<F8>{}, max) for an fp8 dtype; false for any other dtype.
template <typename Fn>
bool dispatch_fp8_dtype(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat8_e4m3fn: fn(TypeTag<c10::Float8_e4m3fn>{}, 448.0f); return true;
    case at::kFloat8_e5m2: fn(TypeTag<c10::Float8_e5m2>{}, 57344.0f); return true;
    default: return false;
  }
}

}  // namespace megatron_fsdp
