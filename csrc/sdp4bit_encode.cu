// TLq-HS first hop of SDP4Bit on the GPU: [32-point Hadamard +] 8-bit stochastic group quantization
// + packing in partition order, for fp32 or bf16 buckets. Same contract and output bytes as the
// Triton `encode_partitioned_kernel` and the torch reference
// `megacoat.comm.codecs.encode_partitioned_reference` (the specification): every fp32 operation is
// the same IEEE-rounded one in the same order (explicit __f*_rn intrinsics: no FMA contraction, no
// fast math; the one fma has an exact product of +-1, see fwht32), the butterflies run in the
// reference's order (h = 1, 2, 4, 8, 16; (a + b, a - b)),
// the random offsets come from the same 32-bit hash of the stream index.
//
// Layout: a lane pair owns one 32-element Hadamard block and holds 16 elements of it in registers,
// loaded as 16-byte vectors (fp32: 4 elements, bf16: 8); the element-index bit that tells the two
// lanes apart is LB = log2(elements per vector). All butterfly stages but the one over bit LB stay
// in registers; that one is a single shuffle per value (1 shuffle per element, against 3 with 4
// elements per lane). A warp handles 512 elements per iteration: 512 / G groups of G lanes / 16.
// Codes are exchanged once between the two lanes so that each stores 16 contiguous bytes.

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
    // pair index p = e / 2 (mod 2^32) of the lane's first element pair; e0 (stream index of the block) is even
    const uint32_t pt = (uint32_t)(((uint64_t)d * (uint64_t)P.n + (uint64_t)pos0) >> 1) + (t << (LB - 1));
    const uint32_t one = P.one_bits;  // in a register: (a & mask) | one is one LOP3
    constexpr uint32_t kMask = 0x7FFF80u;
    constexpr int kLo = kMagicBits - kQmax, kHi = kMagicBits + kQmax;  // q in [-qmax, qmax]
    uint32_t word[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      int c[4];
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const int r = 4 * m + i;
        // One hash per pair: element 2p takes the low 16 bits of h = y ^ (y >> 16), 2p + 1 the high
        // ones; offset = float(1.bits16|1) - 1.5 with bits16 at mantissa bits 7..22. From y directly:
        // (h << 7) & mask = ((y << 7) ^ (y >> 9)) & mask and (h >> 9) & mask = (y >> 9) & mask.
        uint32_t y = (pt + (uint32_t)(elem<LB>(r, 0) >> 1)) ^ P.k1;
        y += P.k2;
        y ^= y >> 16;
        y *= kC1;
        y ^= y >> 15;
        y *= kC2;
        const uint32_t y9 = y >> 9;
        const float r_lo = __fsub_rn(__uint_as_float((((y << 7) ^ y9) & kMask) | one), 1.5f);
        const float r_hi = __fsub_rn(__uint_as_float((y9 & kMask) | one), 1.5f);
        const float v0 = __fadd_rn(__fmul_rn(x[r], inv), r_lo);
        const float v1 = __fadd_rn(__fmul_rn(x[r + 1], inv), r_hi);
        // bits of v + 1.5 * 2^23 = kMagicBits + round-half-even(v); clamped to q in [-127, 127]
        c[i] = min(max(__float_as_int(__fadd_rn(v0, kMagic)), kLo), kHi);
        c[i + 1] = min(max(__float_as_int(__fadd_rn(v1, kMagic)), kLo), kHi);
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
      uint8_t* dst = msg + pos0 + 16 * t;
      if (P.vec_store) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
      } else {
        uint32_t* d4 = reinterpret_cast<uint32_t*>(dst);
        d4[0] = o[0]; d4[1] = o[1]; d4[2] = o[2]; d4[3] = o[3];
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_partitioned", &encode_partitioned,
        "SDP4Bit TLq-HS encode: [Hadamard +] int8 stochastic group quantization in partition order "
        "(fp32/bf16 bucket); False when the configuration is not covered");
}
