// SDP4Bit's reduce + requantize on the GPU (TLq-HS between hops): nsrc messages (int8 or int4 codes, groups
// of G_IN) -> fp32 sum in source order -> 4-bit stochastic requantization (groups of G) into ndest messages
// of m = n / ndest elements. Same bytes as the Triton `reduce_requantize_kernel` and
// `reduce_requantize_reference`.
//
// Layout: a lane owns 32 consecutive elements (one scale per source when G_IN >= 32), G / 32 lanes a
// group, a warp 1024 elements per iteration; codes arrive as 16-byte vectors and leave as one 16-byte
// store (32 nibbles). The per-element work is what bounds the Triton kernel, so it is cut here:
// - code -> float: one PRMT puts the code byte under the bits of 1.5 * 2^23, one exact subtraction;
// - absmax: one max.NaN of |x| per element (NaN propagates, and its bits are >= kInfBits like Inf);
// - rounding is one fma toward -inf (x * inv + f) and one add toward -inf of 1.5 * 2^23 + 7: the result's
//   low byte is the 4-bit code q + 8 itself (q = floor(x * inv + f) - 1 in [-7, 7]), so packing is a
//   shift-add per pair and PRMTs;
// - the lane's 16 pairs share the hash input's upper bits (codecs.hash_inputs): the first mixing step is
//   one XOR per pair with a per-lane constant.
//
// The torch binding is sdp4bit_binding.cpp.

#include "sdp4bit.h"
#include "sdp4bit_common.cuh"

namespace megacoat_sdp4bit {
namespace {

constexpr int kRqLane = 32;                     // elements per lane
static_assert(kRqUnit == 32 * kRqLane, "a warp: 32 lanes");
constexpr float kMagicQ7 = 12582919.0f;         // 1.5 * 2^23 + 7: low byte of (v + this) toward -inf = q + 8
constexpr float kDeq8 = 12582912.0f + 128.0f;   // (1.5 * 2^23 + code) - this = code - 128, exact
constexpr float kDeq4 = 12582912.0f + 8.0f;

__device__ __forceinline__ float absmax_nan(float a, float b) {  // max(|a|, |b|), NaN if either is
  float r;
  asm("{\n\t.reg .f32 ta, tb;\n\tabs.f32 ta, %1;\n\tabs.f32 tb, %2;\n\tmax.NaN.f32 %0, ta, tb;\n\t}"
      : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The lane's codes (BITS 32-bit words at p) and scale (at sp) of one source message.
template <int BITS>
__device__ __forceinline__ void rq_load(bool vec, const uint8_t* p, const float* sp, uint32_t (&w)[BITS],
                                        float& scale) {
  if (vec) {
#pragma unroll
    for (int k = 0; k < BITS / 4; ++k) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p) + k);  // read once: evict first
      w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < BITS; ++k) w[k] = __ldcs(reinterpret_cast<const unsigned int*>(p) + k);
  }
  scale = *sp;
}

// (code - 2^(BITS-1)) * scale, exactly as `dequantize`: the integer value made exact, one fp32 product.
template <int BITS>
__device__ __forceinline__ void rq_dequant(const uint32_t (&w)[BITS], float scale, float (&d)[kRqLane]) {
  constexpr uint32_t kHi = 0x4B400000u;  // its bytes 1..3 are those of 1.5 * 2^23
  if (BITS == 8) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
      for (int b = 0; b < 4; ++b)
        d[4 * k + b] = __fmul_rn(__fsub_rn(__uint_as_float(__byte_perm(w[k], kHi, 0x7650 | b)), kDeq8), scale);
  } else {  // element 8k + j in bits 4j..4j+3 of word k
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = w[k] & 0x0F0F0F0Fu, hi = (w[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        d[8 * k + 2 * b] = __fmul_rn(__fsub_rn(__uint_as_float(__byte_perm(lo, kHi, 0x7650 | b)), kDeq4), scale);
        d[8 * k + 2 * b + 1] = __fmul_rn(__fsub_rn(__uint_as_float(__byte_perm(hi, kHi, 0x7650 | b)), kDeq4), scale);
      }
    }
  }
}

// NSRC > 0: that many sources, all loads issued first; 0: P.nsrc sources in a loop. VEC: 16-byte code
// loads (a template flag: predicated-off loads would still take issue slots).
template <int BITS, int G, int NSRC, bool VEC>
__global__ void __launch_bounds__(kWarps * 32) requant_kernel(const RqParams P) {
  constexpr int LPG = G / kRqLane;  // lanes per group
  constexpr int GPU = kRqUnit / G;  // groups per unit
  const int lane = threadIdx.x & 31;
  const int sub = lane % LPG;
  const uint32_t d = blockIdx.y;
  uint8_t* msg_out = P.out + (int64_t)d * P.msg_out;
  for (uint32_t u = blockIdx.x * kWarps + threadIdx.x / 32; u < P.units; u += gridDim.x * kWarps) {
    uint32_t j = u * GPU + lane / LPG;  // group within destination d
    const bool active = j < P.groups_per_dest;
    if (!active) j = P.groups_per_dest - 1;  // computes the last group again, stores nothing
    const int64_t pos0 = (int64_t)j * G + sub * kRqLane;  // within destination d's message
    const int64_t e0 = (int64_t)d * P.m + pos0;          // within the n summed elements: the stream index
    const uint8_t* cp = P.in + e0 * BITS / 8;            // source 0's codes and scale; + msg_in per source
    const float* sp = reinterpret_cast<const float*>(P.in + P.in_scales) + (e0 >> P.gin_shift);
    float x[kRqLane];
    if constexpr (NSRC > 0) {
      uint32_t w[NSRC > 0 ? NSRC : 1][BITS];
      float sc[NSRC > 0 ? NSRC : 1];
#pragma unroll
      for (int s = 0; s < NSRC; ++s)
        rq_load<BITS>(VEC, cp + s * P.msg_in, reinterpret_cast<const float*>(
                      reinterpret_cast<const uint8_t*>(sp) + s * P.msg_in), w[s], sc[s]);
      rq_dequant<BITS>(w[0], sc[0], x);  // the reference's 0 + first term is the first term (never -0)
#pragma unroll
      for (int s = 1; s < NSRC; ++s) {
        float y[kRqLane];
        rq_dequant<BITS>(w[s], sc[s], y);
#pragma unroll
        for (int i = 0; i < kRqLane; ++i) x[i] = __fadd_rn(x[i], y[i]);  // source order
      }
    } else {
      for (int s = 0; s < P.nsrc; ++s) {
        uint32_t w[BITS];
        float sc;
        rq_load<BITS>(VEC, cp, sp, w, sc);
        cp += P.msg_in;
        sp = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(sp) + P.msg_in);
        float y[kRqLane];
        rq_dequant<BITS>(w, sc, y);
#pragma unroll
        for (int i = 0; i < kRqLane; ++i) x[i] = s ? __fadd_rn(x[i], y[i]) : y[i];
      }
    }

    // Group absmax: a tree of max.NaN(|a|, |b|), then an integer max of the bits across the group's lanes.
    float t[kRqLane / 2];
#pragma unroll
    for (int i = 0; i < kRqLane / 2; ++i) t[i] = absmax_nan(x[2 * i], x[2 * i + 1]);
#pragma unroll
    for (int i = 0; i < 8; ++i) t[i] = absmax_nan(t[i], t[i + 8]);
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = absmax_nan(t[i], t[i + 4]);
    t[0] = absmax_nan(absmax_nan(t[0], t[2]), absmax_nan(t[1], t[3]));
    int amax_b = __float_as_int(t[0]);
#pragma unroll
    for (int k = 1; k < LPG; k <<= 1) amax_b = max(amax_b, __shfl_xor_sync(kFull, amax_b, k));
    const bool bad = amax_b >= kInfBits;
    const bool pos = amax_b >= kMinAmaxBits && !bad;
    const float amax = __int_as_float(pos ? amax_b : kOneBits);
    const float qmax = 7.f;
    const float scale = bad ? __int_as_float(kNanBits) : (pos ? __fdiv_rn(amax, qmax) : 1.f);
    const float inv = pos ? __fdiv_rn(qmax, amax) : 0.f;

    // The lane's 16 pairs (e0 is a multiple of 32) hash (A << 4) | i, A = ((p0 >> 4) ^ k1) + k2: the first
    // mixing step x ^ (x >> 16) is Z ^ i with Z = x0 ^ (x0 >> 16), x0 = A << 4.
    const uint32_t A = ((uint32_t)((uint64_t)e0 >> 5) ^ P.k1) + P.k2;
    const uint32_t x0 = A << 4;
    const uint32_t Z = x0 ^ (x0 >> 16);
    const uint32_t one = P.one_bits;
    uint32_t pairs[kRqLane / 2];  // low byte: codes of elements 2i (low nibble) and 2i + 1
#pragma unroll
    for (int i = 0; i < kRqLane / 2; ++i) {
      uint32_t y = Z ^ (uint32_t)i;
      y *= kC1;
      y ^= y >> 15;
      y *= kC2;
      // h = y ^ (y >> 16): element 2p takes its low 16 bits, 2p + 1 the high ones (those of y), as
      // f = 1 + u = float(1.bits16|1) with bits16 at mantissa bits 7..22 (disjoint from `one`).
      const uint32_t y16 = y >> 16;
      const float f_lo = __uint_as_float((((y ^ y16) & 0xFFFFu) << 7) + one);
      const float f_hi = __uint_as_float((y16 << 7) + one);
      // q = floor(x * inv + f) - 1 (fma toward -inf keeps the exact floor); low byte: q + 8 in [1, 15]
      const uint32_t c0 = __float_as_uint(__fadd_rd(__fmaf_rd(x[2 * i], inv, f_lo), kMagicQ7));
      const uint32_t c1 = __float_as_uint(__fadd_rd(__fmaf_rd(x[2 * i + 1], inv, f_hi), kMagicQ7));
      pairs[i] = c0 + (c1 << 4);  // the low byte cannot carry: c0's is < 16, (c1 << 4)'s has zero low nibble
    }
    uint32_t o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t wd = __byte_perm(__byte_perm(pairs[4 * k], pairs[4 * k + 1], 0x0040),
                                      __byte_perm(pairs[4 * k + 2], pairs[4 * k + 3], 0x0040), 0x5410);
      o[k] = bad ? 0x88888888u : wd;  // non-finite group: q = 0
    }
    if (active) {
      store_codes16(msg_out + pos0 / 2, o, P.vec_store);
      if (sub == 0) reinterpret_cast<float*>(msg_out + P.out_scales)[j] = scale;
    }
  }
}

template <int BITS, int G>
void rq_launch_g(const RqParams& P, dim3 grid, cudaStream_t stream) {
  // unrolled variants for the common source counts with aligned messages; a source loop otherwise
  if (P.vec_load && P.nsrc == 1) requant_kernel<BITS, G, 1, true><<<grid, kWarps * 32, 0, stream>>>(P);
  else if (P.vec_load && P.nsrc == 2) requant_kernel<BITS, G, 2, true><<<grid, kWarps * 32, 0, stream>>>(P);
  else if (P.vec_load) requant_kernel<BITS, G, 0, true><<<grid, kWarps * 32, 0, stream>>>(P);
  else requant_kernel<BITS, G, 0, false><<<grid, kWarps * 32, 0, stream>>>(P);
}

template <int BITS>
bool rq_launch(const RqParams& P, int64_t group, dim3 grid, cudaStream_t stream) {
  switch (group) {
    case 32: rq_launch_g<BITS, 32>(P, grid, stream); return true;
    case 64: rq_launch_g<BITS, 64>(P, grid, stream); return true;
    case 128: rq_launch_g<BITS, 128>(P, grid, stream); return true;
    case 256: rq_launch_g<BITS, 256>(P, grid, stream); return true;
    case 512: rq_launch_g<BITS, 512>(P, grid, stream); return true;
    default: return false;
  }
}

}  // namespace

cudaError_t launch_requantize(const RqParams& P, int bits_in, int group, dim3 grid, cudaStream_t stream) {
  const bool ok = bits_in == 8 ? rq_launch<8>(P, group, grid, stream) : rq_launch<4>(P, group, grid, stream);
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace megacoat_sdp4bit
