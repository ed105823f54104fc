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
// Further below: the reduce + requantize between the hops (int8/int4 messages -> int4), same extension.

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr uint32_t kC1 = 0x045D9F3Bu, kC2 = 0x119DE1F3u;  // hash constants (kernels/sdp4bit.py)
constexpr int kMinAmaxBits = 0x0F800000;                  // 2^-96: smaller groups are sent as zeros
constexpr int kInfBits = 0x7F800000;
constexpr int kOneBits = 0x3F800000;
constexpr int kNanBits = 0x7FC00000;                      // torch's float("nan")
constexpr float kMagic = 12582912.0f;                     // 1.5 * 2^23
constexpr int kMagicBits = 0x4B400000;
constexpr int kQmax = 127;
constexpr int kUnit = 512;  // elements per warp and iteration (32 lanes x 16)
constexpr int kWarps = 8;
constexpr unsigned kFull = 0xFFFFFFFFu;

struct Params {
  const void* src;
  uint8_t* out;
  int64_t shard_size, slice_off, slice_len;
  int64_t n;          // elements per message (nblocks * slice_len)
  int64_t msg_bytes;  // bytes per message (row stride of out)
  uint32_t groups_per_slice, ndest, total_groups, units;
  uint32_t k1, k2;
  uint32_t one_bits;  // 0x3F800040: fp32 1 + 2^-17, the offsets' constant bits
  int vec_store;  // 16-byte code stores (out and msg_bytes 16-byte aligned), else 4-byte ones
};

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

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

// Returns false (nothing launched) for what this kernel does not cover: bits != 8, groups other
// than 32..512 (powers of two), sources not 16-byte aligned at every block; the caller then runs the
// Triton kernel. max_blocks > 0 caps the grid (the warps then loop), 0: one warp per 512 elements.
bool encode_partitioned(torch::Tensor src, torch::Tensor out, int64_t shard_size, int64_t slice_off,
                        int64_t slice_len, int64_t ndest, int64_t nblocks, int64_t bits, int64_t group, bool hadamard,
                        int64_t k1, int64_t k2, int64_t max_blocks) {
  const bool bf16 = src.scalar_type() == at::kBFloat16;
  if (bits != 8 || group < 32 || group > 512 || (group & (group - 1))) return false;
  if (!src.is_cuda() || !src.is_contiguous() || !(bf16 || src.scalar_type() == at::kFloat)) return false;
  const int64_t V = bf16 ? 8 : 4;  // elements per 16-byte load
  if (!aligned(src.data_ptr(), 16) || shard_size % V || slice_off % V) return false;
  TORCH_CHECK(slice_len > 0 && slice_len % group == 0 && ndest > 0 && nblocks > 0 && slice_off >= 0 &&
              slice_off + slice_len <= shard_size, "sdp4bit encode: slices hold whole groups inside a shard");
  TORCH_CHECK(src.numel() >= ndest * nblocks * shard_size, "sdp4bit encode: the bucket is smaller than its shards");
  const int64_t n = nblocks * slice_len;
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kByte && out.dim() == 2 && out.size(0) == ndest &&
              out.is_contiguous() && out.get_device() == src.get_device(),
              "sdp4bit encode: out must be a contiguous uint8 CUDA tensor [ndest, message bytes] on the bucket's "
              "device");
  const int64_t msg_bytes = out.size(1);
  TORCH_CHECK(msg_bytes >= n + 4 * (n / group), "sdp4bit encode: message rows are too short");
  if (!aligned(out.data_ptr(), 4) || msg_bytes % 4) return false;
  const int64_t groups = ndest * nblocks * (slice_len / group);
  if (groups >= (int64_t(1) << 31)) return false;
  Params P;
  P.src = src.data_ptr();
  P.out = out.data_ptr<uint8_t>();
  P.shard_size = shard_size;
  P.slice_off = slice_off;
  P.slice_len = slice_len;
  P.n = n;
  P.msg_bytes = msg_bytes;
  P.groups_per_slice = (uint32_t)(slice_len / group);
  P.ndest = (uint32_t)ndest;
  P.total_groups = (uint32_t)groups;
  const int64_t per_unit = kUnit / group;
  P.units = (uint32_t)((groups + per_unit - 1) / per_unit);
  P.k1 = (uint32_t)k1;
  P.k2 = (uint32_t)k2;
  P.one_bits = 0x3F800040u;
  P.vec_store = aligned(out.data_ptr(), 16) && msg_bytes % 16 == 0;
  int64_t blocks = (P.units + kWarps - 1) / kWarps;
  if (max_blocks > 0 && blocks > max_blocks) blocks = max_blocks;
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool ok = bf16 ? launch_t<__nv_bfloat16>(P, group, hadamard, (int)blocks, stream)
                       : launch_t<float>(P, group, hadamard, (int)blocks, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return ok;
}

namespace {

// ------------------------------------------------------------------------------------------------
// TLq-HS between hops: nsrc messages (int8 or int4 codes, groups of G_IN) -> fp32 sum in source order
// -> 4-bit stochastic requantization (groups of G) into ndest messages of m = n / ndest elements. Same
// bytes as the Triton `reduce_requantize_kernel` and `reduce_requantize_reference`.
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

constexpr int kRqLane = 32;                     // elements per lane
constexpr int kRqUnit = 32 * kRqLane;           // elements per warp and iteration
constexpr float kMagicQ7 = 12582919.0f;         // 1.5 * 2^23 + 7: low byte of (v + this) toward -inf = q + 8
constexpr float kDeq8 = 12582912.0f + 128.0f;   // (1.5 * 2^23 + code) - this = code - 128, exact
constexpr float kDeq4 = 12582912.0f + 8.0f;

struct RqParams {
  const uint8_t* in;
  uint8_t* out;
  int64_t msg_in, msg_out;  // bytes per message (row strides)
  int64_t in_scales;        // byte offset of the scales in an input message: n * bits_in / 8
  int64_t out_scales;       // in an output message: m / 2
  int64_t m;                // elements per destination
  uint32_t groups_per_dest, units;  // units: warp iterations per destination
  int nsrc, gin_shift;      // G_IN = 1 << gin_shift
  uint32_t k1, k2;
  uint32_t one_bits;        // 0x3F800040
  int vec_load, vec_store;  // 16-byte code loads / stores (else 4-byte ones)
};

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

// Returns false (nothing launched) for what this kernel does not cover: bits_out != 4, bits_in other
// than 4 / 8, output groups other than 32..512 or input groups other than powers of two >= 32, more
// than 65535 destinations, messages not 4-byte aligned; the caller then runs the Triton kernel.
// max_blocks > 0 caps the grid's x dimension (the warps then loop).
bool reduce_requantize(torch::Tensor msgs, torch::Tensor out, int64_t n, int64_t bits_in, int64_t group_in,
                       int64_t bits_out, int64_t group_out, int64_t ndest, int64_t k1, int64_t k2,
                       int64_t max_blocks) {
  if (bits_out != 4 || (bits_in != 4 && bits_in != 8)) return false;
  if (group_out < 32 || group_out > 512 || (group_out & (group_out - 1))) return false;
  if (group_in < 32 || (group_in & (group_in - 1))) return false;
  if (!msgs.is_cuda() || ndest < 1 || ndest > 65535) return false;
  TORCH_CHECK(msgs.scalar_type() == at::kByte && msgs.dim() == 2 && msgs.size(0) >= 1 && msgs.is_contiguous(),
              "sdp4bit reduce_requantize: msgs must be a contiguous uint8 CUDA tensor [nsrc, message bytes]");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kByte && out.dim() == 2 && out.size(0) == ndest &&
              out.is_contiguous() && out.get_device() == msgs.get_device(),
              "sdp4bit reduce_requantize: out must be a contiguous uint8 CUDA tensor [ndest, message bytes] on the "
              "messages' device");
  TORCH_CHECK(n > 0 && n % ndest == 0 && n % group_in == 0 && (n / ndest) % group_out == 0,
              "sdp4bit reduce_requantize: messages hold whole groups");
  const int64_t m = n / ndest;
  const int64_t msg_in = msgs.size(1), msg_out = out.size(1);
  TORCH_CHECK(msg_in >= n * bits_in / 8 + 4 * (n / group_in),
              "sdp4bit reduce_requantize: input messages are too short");
  TORCH_CHECK(msg_out >= m / 2 + 4 * (m / group_out), "sdp4bit reduce_requantize: output messages are too short");
  if (!aligned(msgs.data_ptr(), 4) || msg_in % 4 || !aligned(out.data_ptr(), 4) || msg_out % 4) return false;
  if (m / group_out >= (int64_t(1) << 31)) return false;
  RqParams P;
  P.in = msgs.data_ptr<uint8_t>();
  P.out = out.data_ptr<uint8_t>();
  P.msg_in = msg_in;
  P.msg_out = msg_out;
  P.in_scales = n * bits_in / 8;
  P.out_scales = m / 2;
  P.m = m;
  P.groups_per_dest = (uint32_t)(m / group_out);
  const int64_t per_unit = kRqUnit / group_out;
  P.units = (uint32_t)((P.groups_per_dest + per_unit - 1) / per_unit);
  P.nsrc = (int)msgs.size(0);
  int shift = 0;
  while ((int64_t(1) << shift) < group_in) ++shift;
  P.gin_shift = shift;
  P.k1 = (uint32_t)k1;
  P.k2 = (uint32_t)k2;
  P.one_bits = 0x3F800040u;
  P.vec_load = aligned(msgs.data_ptr(), 16) && msg_in % 16 == 0;
  P.vec_store = aligned(out.data_ptr(), 16) && msg_out % 16 == 0;
  int64_t blocks = (P.units + kWarps - 1) / kWarps;
  if (max_blocks > 0 && blocks > max_blocks) blocks = max_blocks;
  const dim3 grid((unsigned)blocks, (unsigned)ndest);
  const c10::cuda::CUDAGuard guard(msgs.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool ok = bits_in == 8 ? rq_launch<8>(P, group_out, grid, stream) : rq_launch<4>(P, group_out, grid, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return ok;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_partitioned", &encode_partitioned,
        "SDP4Bit TLq-HS encode: [Hadamard +] int8 stochastic group quantization in partition order "
        "(fp32/bf16 bucket); False when the configuration is not covered");
  m.def("reduce_requantize", &reduce_requantize,
        "SDP4Bit TLq-HS between hops: sum of dequantized int8/int4 messages -> int4 requantization; False when "
        "the configuration is not covered");
}
