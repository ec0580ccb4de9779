// CRC-32C (Castagnoli): the checksum of checkpoint files.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megatron_fsdp {

// The CRC-32C of `data` continued from `crc` (the CRC of the bytes before
// it; 0 to start), as zlib.crc32(data, value) continues CRC-32. Uses the
// CPU's crc32 instruction (SSE4.2) when it has one.
uint32_t crc32c(uint32_t crc, const void* data, size_t size);

// The same with lookup tables only: what CPUs without SSE4.2 run.
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t size);

bool crc32c_uses_hardware();

}  // namespace megatron_fsdp
