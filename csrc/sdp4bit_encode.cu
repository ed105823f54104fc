// TLq-HS first hop of SDP4Bit on the GPU: [32-point Hadamard +] 8-bit stochastic group quantization
// + packing in partition order, for fp32 or bf16 buckets. Same contract and output bytes as the
// Triton `encode_partitioned_kernel` and the torch reference
// `megacoat.comm.codecs.encode_partitioned_reference` (the specification): every fp32 operation is
// the same IEEE-rounded one in the same order (explicit __f*_rn intrinsics: no FMA contraction, no
// fast math; the butterflies' one fma has an exact product of +-1, see fwht32), except the
// quantizer's floor, an fma and an add rounded toward -inf (__fmaf_rd, __fadd_rd) that give the
// reference's exact floor(x * inv + f); the butterflies run in the reference's order (h = 1, 2, 4, 8,
// 16; (a + b, a - b)); the random offsets come from the same 32-bit hash of the stream index.
//
// Layout: a lane pair owns one 32-element Hadamard block and holds 16 elements of it in registers,
// loaded as 16-byte vectors (fp32: 4 elements, bf16: 8); the element-index bit that tells the two
// lanes apart is LB = log2(elements per vector). All butterfly stages but the one over bit LB stay
// in registers; that one is a single shuffle per value (1 shuffle per element, against 3 with 4
// elements per lane). A warp handles 512 elements per iteration: 512 / G groups of G lanes / 16.
// Codes are exchanged once between the two lanes so that each stores 16 contiguous bytes.
//
// The reduce + requantize between the hops is in sdp4bit_requantize.cu, the torch binding in sdp4bit_binding.cpp.

#include <cuda_bf16.h>

#include "sdp4bit.h"
#include "sdp4bit_common.cuh"

namespace megacoat_sdp4bit {
namespace {

// 16 elements of the lane's block: vector k holds block elements (2k + t) * V .. + V - 1.
template <typename T>
struct Src;

template <>
struct Src<float> {
  static constexpr int LB = 2;  // log2 of the elements per 16-byte vector
  static __device__ __forceinline__ void load(const float* p, int t, float (&x)[16]) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 v = __ldcs(q + 2 * k + t);  // streamed once: evict first
      x[4 * k] = v.x; x[4 * k + 1] = v.y; x[4 * k + 2] = v.z; x[4 * k + 3] = v.w;
    }
  }
};

template <>
struct Src<__nv_bfloat16> {
  static constexpr int LB = 3;
  static __device__ __forceinline__ void load(const __nv_bfloat16* p, int t, float (&x)[16]) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint4 v = __ldcs(q + 2 * k + t);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // bf16 -> fp32 is exact: the bits move up 16 places
        x[8 * k + 2 * i] = __uint_as_float(w[i] << 16);
        x[8 * k + 2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      }
    }
  }
};

// Block element index of register r in lane half t: bit LB of the index is t.
template <int LB>
__device__ __forceinline__ constexpr int elem(int r, int t) {
  return (r & ((1 << LB) - 1)) | (t << LB) | ((r >> LB) << (LB + 1));
}

// Unnormalised Sylvester Hadamard of the block, stages h = 1, 2, 4, 8, 16 (the reference's order);
// each stage maps (x_i, x_i+h) -> (x_i + x_i+h, x_i - x_i+h). Lane t = 1 ends with the NEGATED
// values: its cross-lane step computes x_i+h - x_i = -(x_i - x_i+h) as one fma(o, -1, x) (the
// product is exact: one rounding, as the subtraction), and RN is symmetric, so every later sum and
// difference is the exact negative too. Signs of zeros may differ; they reach no code or scale.
template <int LB>
__device__ __forceinline__ void fwht32(float (&x)[16], int t) {
  const float sgn = t ? -1.f : 1.f;
#pragma unroll
  for (int s = 0; s < 5; ++s) {
    if (s == LB) {  // partner lane holds x_i+h (t = 0) or x_i (t = 1)
#pragma unroll
      for (int r = 0; r < 16; ++r) x[r] = __fmaf_rn(__shfl_xor_sync(kFull, x[r], 1), sgn, x[r]);
    } else {
      const int h = 1 << (s < LB ? s : s - 1);
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        if (!(r & h)) {
          const float a = x[r], b = x[r + h];
          x[r] = __fadd_rn(a, b);
          x[r + h] = __fsub_rn(a, b);
        }
      }
    }
  }
}

template <typename T, int G, bool HAD>
__global__ void __launch_bounds__(kWarps * 32) encode_kernel(const Params P) {
  constexpr int LB = Src<T>::LB;
  constexpr int LPG = G / 16;     // lanes per group
  constexpr int GPU = kUnit / G;  // groups per unit
  const int lane = threadIdx.x & 31;
  const int t = lane & 1;
  const int blk = (lane % LPG) >> 1;  // block within the group
  const uint32_t nwarps = gridDim.x * kWarps;
  for (uint32_t u = blockIdx.x * kWarps + threadIdx.x / 32; u < P.units; u += nwarps) {
    const uint32_t gi = u * GPU + lane / LPG;  // group in source order (shard b * ndest + d, group j)
    const bool active = gi < P.total_groups;
    const uint32_t s = gi / P.groups_per_slice, j = gi - s * P.groups_per_slice;
    const uint32_t b = s / P.ndest, d = s - b * P.ndest;
    const int64_t in_slice = (int64_t)j * G + blk * 32;
    float x[16];
    if (active) {
      Src<T>::load(static_cast<const T*>(P.src) + (int64_t)s * P.shard_size + P.slice_off + in_slice, t, x);
    } else {
#pragma unroll
      for (int r = 0; r < 16; ++r) x[r] = 0.f;
    }
    if (HAD) fwht32<LB>(x, t);

    // Group absmax over the fp32 bits with the sign cleared (they order like |x|; Inf/NaN >= kInfBits).
    int amax_b = 0;
#pragma unroll
    for (int r = 0; r < 16; ++r) amax_b = max(amax_b, __float_as_int(x[r]) & 0x7FFFFFFF);
#pragma unroll
    for (int m = 1; m < LPG; m <<= 1) amax_b = max(amax_b, __shfl_xor_sync(kFull, amax_b, m));
    const bool bad = amax_b >= kInfBits;
    const bool pos = amax_b >= kMinAmaxBits && !bad;
    const float amax = __int_as_float(pos ? amax_b : kOneBits);
    const float qmax = (float)kQmax;
    const float scale = bad ? __int_as_float(kNanBits) : (pos ? __fdiv_rn(amax, qmax) : 1.f);
    float inv = pos ? __fdiv_rn(qmax, amax) : 0.f;
    if (HAD && t) inv = -inv;  // (-x) * (-inv) == x * inv exactly

    const int64_t pos0 = (int64_t)b * P.slice_len + in_slice;  // block start within message d
    // The block's 16 element pairs (stream index d * n + pos0, a multiple of 32) share the hash input's
    // upper 28 bits x0 = A << 4, A = ((p >> 4) ^ k1) + k2; pair j of the block hashes x0 | j, whose first
    // mixing step x ^ (x >> 16) is Z ^ j with Z = x0 ^ (x0 >> 16): one XOR per pair. This lane's pairs
    // are j = (t << (LB - 1)) | (elem(r, 0) >> 1).
    const uint32_t A = (((uint32_t)(((uint64_t)d * (uint64_t)P.n + (uint64_t)pos0) >> 5)) ^ P.k1) + P.k2;
    const uint32_t x0 = A << 4;
    const uint32_t Zt = (x0 ^ (x0 >> 16)) ^ (uint32_t)(t << (LB - 1));
    const uint32_t one = P.one_bits;  // in a register: (a & mask) | one is one LOP3
    constexpr uint32_t kMask = 0x7FFF80u;
    uint32_t word[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      int c[4];
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const int r = 4 * m + i;
        // One hash per pair: element 2p takes the low 16 bits of h = y ^ (y >> 16), 2p + 1 the high
        // ones, as f = 1 + u = float(1.bits16|1) with bits16 at mantissa bits 7..22. From y directly:
        // (h << 7) & mask = ((y << 7) ^ (y >> 9)) & mask and (h >> 9) & mask = (y >> 9) & mask.
        uint32_t y = Zt ^ (uint32_t)(elem<LB>(r, 0) >> 1);
        y *= kC1;
        y ^= y >> 15;
        y *= kC2;
        const uint32_t y9 = y >> 9;
        const float f_lo = __uint_as_float((((y << 7) ^ y9) & kMask) | one);
        const float f_hi = __uint_as_float((y9 & kMask) | one);
        // q = floor(x * inv + f) - 1: the fma rounded toward -inf keeps the exact floor, and adding
        // 1.5 * 2^23 - 1 toward -inf leaves kMagicBits + q in the bits; |q| <= 127 without a clamp.
        c[i] = __float_as_int(__fadd_rd(__fmaf_rd(x[r], inv, f_lo), kMagic - 1.f));
        c[i + 1] = __float_as_int(__fadd_rd(__fmaf_rd(x[r + 1], inv, f_hi), kMagic - 1.f));
      }
      // low bytes are q mod 256; code = q + 128 = (q mod 256) ^ 0x80
      const uint32_t w = __byte_perm(__byte_perm(c[0], c[1], 0x0040), __byte_perm(c[2], c[3], 0x0040), 0x5410);
      word[m] = bad ? 0x80808080u : (w ^ 0x80808080u);  // non-finite group: q = 0
    }
    // Local word m holds block word (code bytes 4w..4w+3) w(m, t); lane t keeps the two words with
    // bit 2 of w equal to t (m = 2t, 2t + 1) and swaps the other two with its partner.
    const uint32_t s0 = t ? word[0] : word[2], s1 = t ? word[1] : word[3];
    const uint32_t r0 = __shfl_xor_sync(kFull, s0, 1), r1 = __shfl_xor_sync(kFull, s1, 1);
    const uint32_t k0 = t ? word[2] : word[0], k1 = t ? word[3] : word[1];
    uint32_t o[4];  // selects, not indexing by t (that would put o in local memory)
    if (LB == 2) {  // w = t | m << 1
      o[0] = t ? r0 : k0; o[1] = t ? k0 : r0; o[2] = t ? r1 : k1; o[3] = t ? k1 : r1;
    } else {        // w = (m & 1) | t << 1 | (m >> 1) << 2
      o[0] = t ? r0 : k0; o[1] = t ? r1 : k1; o[2] = t ? k0 : r0; o[3] = t ? k1 : r1;
    }
    if (active) {
      uint8_t* msg = P.out + (int64_t)d * P.msg_bytes;
      store_codes16(msg + pos0 + 16 * t, o, P.vec_store);
      if (lane % LPG == 0)
        reinterpret_cast<float*>(msg + P.n)[(int64_t)b * P.groups_per_slice + j] = scale;
    }
  }
}

template <typename T, int G>
void launch_g(const Params& P, bool had, int blocks, cudaStream_t stream) {
  if (had) encode_kernel<T, G, true><<<blocks, kWarps * 32, 0, stream>>>(P);
  else encode_kernel<T, G, false><<<blocks, kWarps * 32, 0, stream>>>(P);
}

template <typename T>
bool launch_t(const Params& P, int64_t group, bool had, int blocks, cudaStream_t stream) {
  switch (group) {
    case 32: launch_g<T, 32>(P, had, blocks, stream); return true;
    case 64: launch_g<T, 64>(P, had, blocks, stream); return true;
    case 128: launch_g<T, 128>(P, had, blocks, stream); return true;
    case 256: launch_g<T, 256>(P, had, blocks, stream); return true;
    case 512: launch_g<T, 512>(P, had, blocks, stream); return true;
    default: return false;
  }
}

}  // namespace

cudaError_t launch_encode(const Params& P, bool bf16, int group, bool hadamard, int blocks, cudaStream_t stream) {
  const bool ok = bf16 ? launch_t<__nv_bfloat16>(P, group, hadamard, blocks, stream)
                       : launch_t<float>(P, group, hadamard, blocks, stream);
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace megacoat_sdp4bit
