// CRC-32C (polynomial 0x1EDC6F41, reflected 0x82F63B78; initial value and
// final xor 0xFFFFFFFF: the iSCSI / ext4 / Castagnoli checksum).
//
// x86 CPUs with SSE4.2 compute it with the crc32 instruction. One chain of
// those instructions is bound by their latency (3 cycles for 8 bytes), so
// three independent streams run interleaved over three adjacent blocks and
// are then joined: CRC(A B C) = Z_2n(CRC(A)) ^ Z_n(CRC(B)) ^ CRC(C), where
// Z_n (appending n zero bytes) is linear, applied with four table lookups.
// Elsewhere the table-driven slicing-by-8 runs.

#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MFSDP_CRC32C_X86 1
#include <nmmintrin.h>
#endif

namespace megatron_fsdp {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;
constexpr size_t kLongBlock = 8192;  // bytes per stream: the shift cost is amortized
constexpr size_t kShortBlock = 256;  // for the rest of a large buffer, and medium ones

// Z_n as four tables: Z_n(c) = t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ ...
struct Shift {
  uint32_t t[4][256];
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

// A linear map of 32-bit words over GF(2): column i is the image of bit i.
struct Matrix {
  uint32_t col[32];
  uint32_t apply(uint32_t v) const {
    uint32_t r = 0;
    for (int i = 0; v != 0; ++i, v >>= 1) {
      if (v & 1) r ^= col[i];
    }
    return r;
  }
  Matrix then(const Matrix& next) const {  // next after this
    Matrix m;
    for (int i = 0; i < 32; ++i) m.col[i] = next.apply(col[i]);
    return m;
  }
};

struct Tables {
  uint32_t slice[8][256];
  Shift long1, long2, short1, short2;  // Z_n and Z_2n for both block sizes

  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      slice[0][b] = c;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t b = 0; b < 256; ++b) slice[k][b] = (slice[k - 1][b] >> 8) ^ slice[0][slice[k - 1][b] & 0xff];
    }
    fill(long1, kLongBlock);
    fill(long2, 2 * kLongBlock);
    fill(short1, kShortBlock);
    fill(short2, 2 * kShortBlock);
  }

  // The register after one zero byte: linear in the register.
  Matrix zero_byte() const {
    Matrix m;
    for (int i = 0; i < 32; ++i) {
      const uint32_t c = 1u << i;
      m.col[i] = slice[0][c & 0xff] ^ (c >> 8);
    }
    return m;
  }

  void fill(Shift& shift, size_t bytes) const {
    Matrix power = zero_byte(), result;
    for (int i = 0; i < 32; ++i) result.col[i] = 1u << i;
    for (size_t n = bytes; n != 0; n >>= 1) {  // Z_bytes by squaring
      if (n & 1) result = result.then(power);
      power = power.then(power);
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) shift.t[k][b] = result.apply(b << (8 * k));
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// The raw register update (no initial value or final xor).
uint32_t update_portable(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& t = tables();
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  for (; n >= 8; n -= 8, p += 8) {
    const uint64_t w = load64(p) ^ crc;
    crc = t.slice[7][w & 0xff] ^ t.slice[6][(w >> 8) & 0xff] ^ t.slice[5][(w >> 16) & 0xff] ^
          t.slice[4][(w >> 24) & 0xff] ^ t.slice[3][(w >> 32) & 0xff] ^ t.slice[2][(w >> 40) & 0xff] ^
          t.slice[1][(w >> 48) & 0xff] ^ t.slice[0][w >> 56];
  }
#endif
  for (; n > 0; --n, ++p) crc = t.slice[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
  return crc;
}

#ifdef MFSDP_CRC32C_X86
// Three streams of `block` bytes each, while at least 3 * block bytes remain.
__attribute__((target("sse4.2"))) uint32_t three_way(uint32_t crc, const uint8_t*& p, size_t& n, size_t block,
                                                      const Shift& one, const Shift& two) {
  while (n >= 3 * block) {
    uint64_t c0 = crc, c1 = 0, c2 = 0;
    for (const uint8_t* end = p + block; p < end; p += 8) {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + block));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * block));
    }
    crc = two(static_cast<uint32_t>(c0)) ^ one(static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
    p += 2 * block;
    n -= 3 * block;
  }
  return crc;
}

__attribute__((target("sse4.2"))) uint32_t update_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; --n, ++p) crc = _mm_crc32_u8(crc, *p);
  const Tables& t = tables();
  crc = three_way(crc, p, n, kLongBlock, t.long1, t.long2);
  crc = three_way(crc, p, n, kShortBlock, t.short1, t.short2);
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) c = _mm_crc32_u64(c, load64(p));
  crc = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) crc = _mm_crc32_u8(crc, *p);
  return crc;
}
#endif

}  // namespace

bool crc32c_uses_hardware() {
#ifdef MFSDP_CRC32C_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return has;
#else
  return false;
#endif
}

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t size) {
  return ~update_portable(~crc, static_cast<const uint8_t*>(data), size);
}

uint32_t crc32c(uint32_t crc, const void* data, size_t size) {
#ifdef MFSDP_CRC32C_X86
  if (crc32c_uses_hardware()) return ~update_sse42(~crc, static_cast<const uint8_t*>(data), size);
#endif
  return crc32c_portable(crc, data, size);
}

}  // namespace megatron_fsdp
