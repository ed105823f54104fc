// Device helpers shared by SDP4Bit's encode and reduce-requantize kernels.
#pragma once

#include <stdint.h>

namespace megacoat_sdp4bit {
namespace {

constexpr uint32_t kC1 = 0x045D9F3Bu, kC2 = 0x119DE1F3u;  // hash constants (kernels/sdp4bit.py)
constexpr int kMinAmaxBits = 0x0F800000;                  // 2^-96: smaller groups are sent as zeros
constexpr int kInfBits = 0x7F800000;
constexpr int kOneBits = 0x3F800000;
constexpr int kNanBits = 0x7FC00000;                      // torch's float("nan")
constexpr float kMagic = 12582912.0f;                     // 1.5 * 2^23
constexpr int kMagicBits = 0x4B400000;
constexpr int kQmax = 127;
constexpr unsigned kFull = 0xFFFFFFFFu;

// 16 bytes of codes at dst: one vector store when aligned (asm: the compiler must not merge it with
// the 4-byte stores of the other path), else four 4-byte stores.
__device__ __forceinline__ void store_codes16(uint8_t* dst, const uint32_t (&o)[4], bool vec) {
  if (vec) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(o[0]), "r"(o[1]), "r"(o[2]),
                 "r"(o[3]) : "memory");
  } else {
    uint32_t* d4 = reinterpret_cast<uint32_t*>(dst);
    d4[0] = o[0]; d4[1] = o[1]; d4[2] = o[2]; d4[3] = o[3];
  }
}

}  // namespace
}  // namespace megacoat_sdp4bit
