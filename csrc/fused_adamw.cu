// Fused AdamW step over a whole flat optimizer shard, with Adam moments in fp32, bf16 or COAT's
// FP8 (E4M3 groups of 128 with per-group scale s, exponent k, centre c), writing the updated bf16
// weight in the same pass. One launch for the shard. The torch binding is fused_adamw_binding.cpp.
//
// Layout: a persistent grid (as many blocks as fit on the GPU at once) whose warps loop over
// units of consecutive groups; LANES lanes share a group (8: 16 elements each, as 4 runs of 4 contiguous
// ones 32 elements apart, so that per load instruction the 8 lanes of a group read 128 contiguous bytes of
// the master; 16: 8 elements each). Why: the FP8 step was bound by instruction issue, not by memory (one
// group per warp: ~2000 warp instructions per group with expansion), and over half of them were per group
// (divisions and log2f for s, k, c) or per launch (the bias corrections, the log2 table), run by every lane
// of a one-group warp. Now the per-launch work runs once per thread, and the per-group work once per lane
// for LANES (group, moment) pairs: the lower half of a group's lanes works for m, the upper half for v,
// exchanging results by shuffles. Many independent elements per lane also give the loads and the math ILP.
//
// Numerics: the torch reference `megacoat.optim.fp8_adam.reference_step` is the specification.
// Every fp32 operation here is the same IEEE-rounded operation in the same order (explicit __f*_rn
// intrinsics: no FMA contraction, no fast math), pow/log2/exp2 are CUDA's powf/log2f/exp2f, which
// torch's fp32 pow/log2/exp2 call on the GPU; so kernel and reference agree bit for bit. Changed
// in form only: the max / nonzero-min reductions run in another order (exact operations) and the
// expansion negates where the reference multiplies by sign(x) (same clamped value: see quant), and
// sqrt(v) / bc2 is a multiplication by the rounded reciprocal plus Markstein's fma correction, which
// gives the correctly rounded quotient (the division's bits). The one approximation: FP8 moments run the
// update's square root and reciprocal on the MUFU unit (Config::kFastUpdate; see ConfigFor). Build WITHOUT
// --use_fast_math (it would swap the exact operations for the approximate intrinsics and flush denormals).
//
// The skip flag, the clip factor and the step count are read from device memory: the host never
// waits. A skipped step (found_inf != 0) returns before touching anything.

#include "fused_adamw.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <math_constants.h>

#include <algorithm>

namespace megacoat_adamw {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;

// A work distribution and update form; every one performs the same operations per element and per group.
//   LANES        lanes per group (8: 16 elements per lane, 4 groups per warp and iteration; 16: 8
//                elements per lane, 2 groups: about half the registers, per-group work on twice the lanes)
//   MIN_BLOCKS   __launch_bounds__ minimum blocks per SM (register cap 65536 / (256 MIN_BLOCKS))
//   FAST_UPDATE  the parameter update m / (sqrt(v) / bc2 + eps) with the hardware's approximate square
//                root and reciprocal (one MUFU instruction each, <= 2 ulp) instead of the correctly rounded
//                sqrt and division (~25 instructions per element with their slow-path checks). Only the
//                master and the bf16 weight change (within 1e-6 relative of the reference); the moments,
//                their codes and s, k, c do not depend on the master, so they stay bit-identical.
//   PIPELINE     (FP8 moments) every load of the warp's next unit issued as cp.async into shared memory
//                before the current unit's arithmetic: the copies need no registers while in flight, so
//                the GPU no longer alternates between waiting for memory and issuing arithmetic (Nsight
//                Compute found the unpipelined FP8 step at 127 registers, 2 blocks per SM, 42% of its stalls
//                waiting on loads). Each lane reads back only what it copied itself, so no barrier.
template <int LANES, int MIN_BLOCKS, bool FAST_UPDATE, bool PIPELINE>
struct Config {
  static_assert(LANES == 8 || LANES == 16, "8 or 16 lanes per group");
  static constexpr int kLanes = LANES;
  static constexpr int kMinBlocks = MIN_BLOCKS;
  static constexpr bool kFastUpdate = FAST_UPDATE;
  static constexpr bool kPipeline = PIPELINE;
  static constexpr int kGroupsPerWarp = 32 / LANES;  // groups per warp and loop iteration (a unit)
  static constexpr int kRuns = 32 / LANES;           // per lane: runs of 4 contiguous elements
  static constexpr int kPerLane = 4 * kRuns;         // elements per lane
  static constexpr int kRunStride = kGroup / kRuns;  // elements between a lane's runs
};

// The configuration each moment format runs: the fastest measured for it on the H200 with 256M elements by
// benchmarks/optimizer_bench.py (`--parts kernels` times these; the alternatives below were its `variants`
// part, removed with them). fp32 moments: 16 lanes (2.06 ms against 2.09 with 8); bf16: 8 lanes (1.53 ms);
// FP8 moments: 8 lanes, approximate update, pipelined loads (exp2 expansion with fp32 gradients 1.85 ms
// against 1.94 unpipelined, with bf16 gradients 1.66 either way; absmax 1.39 ms against 1.47; the
// approximate update had beaten the fastest exact distribution by 7-10%). fp32 and bf16 moments keep the
// exact update, so their step equals the reference bit for bit (tests/test_fused_adamw_gpu.py checks both).
using ExactWide = Config<16, 3, false, false>;
using ExactNarrow = Config<8, 2, false, false>;
using FastPipelined = Config<8, 2, true, true>;
template <int FMT> struct ConfigFor { using type = FastPipelined; };
template <> struct ConfigFor<kFp32> { using type = ExactWide; };
template <> struct ConfigFor<kBf16> { using type = ExactNarrow; };

__device__ __forceinline__ float fp8_to_float(uint32_t b) {
  __nv_fp8_e4m3 q;
  q.__x = (__nv_fp8_storage_t)b;
  return float(q);
}

// Two E4M3 codes (round to nearest even, saturating), x in the low byte: the same conversion as
// one at a time, one instruction for both.
__device__ __forceinline__ uint32_t float2_to_fp8x2(float x, float y) {
  return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3);
}

// The lane `d` away (xor): with d = LANES / 2 the partner that holds the other moment.
template <int D>
__device__ __forceinline__ float shfl(float x) { return __shfl_xor_sync(0xffffffffu, x, D); }

// exp2f without its denormal path: exp2f(x) is MUFU.EX2 for x >= -126 and, below, ex2(x / 2) squared
// (4 instructions); this is the MUFU.EX2 alone (1), which gives the same bits for x >= -126 and 0 for
// results below 2^-126. Quantizing, that changes no code (anything below 2^-126 is the code +-0, E4M3's
// smallest step being 2^-9); dequantizing, the reference flushes those results to 0 too.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The MUFU approximations (FAST_UPDATE), flushing denormals (.ftz: one MUFU instruction each; without it
// each adds a denormal test and two rescalings, ~6 of the ~137 instructions per element). sqrt keeps 0 -> 0
// and inf -> inf and gives 0 for v below 2^-126, where the exact root (< 2^-63) is lost next to eps anyway;
// rcp of a positive normal denominator (>= eps (1 - b1), far above the denormals) is within 1 ulp.
__device__ __forceinline__ float sqrt_approx(float x) {
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void bf16x4_to_float(uint2 raw, float* x) {
  __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&raw.x);
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&raw.y);
  x[0] = __low2float(a); x[1] = __high2float(a); x[2] = __low2float(b); x[3] = __high2float(b);
}

// One lane's gradients as their raw bits, widened to fp32 where the update uses them. Widening bf16
// right after the loads (bf16x4_to_float) put the unpack before the aligned/scalar branches rejoin, so a
// warp waited for its gradients before issuing the per-group loads (two memory waits in a row; static SASS,
// benchmarks/results/2026-12-01_fused-adamw-bf16-grad-sass_cpu.md). The same bits either way.
template <typename G, int N> struct GradBits;
template <int N> struct GradBits<float, N> {
  using Vec = uint4;  // one run's 4 gradients as loaded
  uint32_t w[N];
  __device__ __forceinline__ void set4(const Vec d, int j) {
    w[4 * j] = d.x; w[4 * j + 1] = d.y; w[4 * j + 2] = d.z; w[4 * j + 3] = d.w;
  }
  __device__ __forceinline__ void load4(const float* p, int j) { set4(__ldg(reinterpret_cast<const Vec*>(p)), j); }
  __device__ __forceinline__ void load1(const float* p, int i, bool in) {
    w[i] = in ? __float_as_uint(__ldg(p)) : 0u;
  }
  __device__ __forceinline__ float operator[](int i) const { return __uint_as_float(w[i]); }
};
template <int N> struct GradBits<__nv_bfloat16, N> {
  using Vec = uint2;
  uint32_t w[N / 2];  // element 2i in the low half (little-endian), as loaded
  __device__ __forceinline__ void set4(const Vec d, int j) { w[2 * j] = d.x; w[2 * j + 1] = d.y; }
  __device__ __forceinline__ void load4(const __nv_bfloat16* p, int j) { set4(__ldg(reinterpret_cast<const Vec*>(p)), j); }
  __device__ __forceinline__ void load1(const __nv_bfloat16* p, int i, bool in) {
    const uint32_t h = in ? (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p)) : 0u;
    w[i / 2] = i % 2 ? (w[i / 2] | (h << 16)) : h;
  }
  __device__ __forceinline__ float operator[](int i) const {  // bf16 -> fp32 is exact: the bits, shifted
    return __uint_as_float(i % 2 ? (w[i / 2] & 0xffff0000u) : (w[i / 2] << 16));
  }
};

__device__ __forceinline__ uint2 float4_to_bf16x4(const float* x) {
  __nv_bfloat162 a = __halves2bfloat162(__float2bfloat16_rn(x[0]), __float2bfloat16_rn(x[1]));
  __nv_bfloat162 b = __halves2bfloat162(__float2bfloat16_rn(x[2]), __float2bfloat16_rn(x[3]));
  return make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
}

// One moment's per-group numbers for dequantization: expansion (1/k, log2 s, log2 c), absmax (-, s, -).
struct Dq {
  float inv_k, s, c;
};

// One moment's new per-group statistics; `a` = k log2 c + log2 s (expansion only).
struct Q {
  float s, k, c, a;
};

// The lane's moment's numbers for a group from its stored s, k, c (expansion). The LANES/2 lanes of a (group,
// moment) share the two log2f, the upper half taking log2 c, the lower log2 s (the same calls on the same inputs).
template <int Q4>
__device__ __forceinline__ Dq dequant_params(float s, float k, float c, int sub) {
  const float inv_k = __fdiv_rn(1.f, k);
  const bool hi = sub & Q4;
  const float l = log2f(hi ? c : s), lo = shfl<Q4>(l);
  return Dq{inv_k, hi ? lo : l, hi ? l : lo};
}

// fp32 value of code b (low 8 bits) under the group's numbers. `tab` (expansion only): per code, log2f
// of its magnitude and the sign of its value (0 for +-0), one shared load for both.
template <int FMT>
__device__ __forceinline__ float dequant(uint32_t b, const Dq& d, const float2* tab) {
  if (FMT == kFp8Expand) {
    const float2 t = tab[b & 0xff];
    // exp2 without denormals, as the reference (fp8_adam.dequantize_groups flushes results below 2^-126)
    return __fmul_rn(t.y, exp2_ftz(__fadd_rn(__fmul_rn(__fadd_rn(t.x, d.s), d.inv_k), d.c)));
  }
  return __fmul_rn(fp8_to_float(b & 0xff), d.s);
}

// New statistics of a group from its max and true nonzero min of |x| (fp8_adam.group_stats, k capped).
// Expansion: log2 c (for a) and log2 R share one log2f over the lanes of the (group, moment).
template <int FMT, int Q4>
__device__ __forceinline__ Q group_stats(float mx, float mn, const Args& A, int sub) {
  mx = __fadd_rn(mx, A.tiny);
  mn = __fadd_rn(isinf(mn) ? 0.f : mn, A.tiny);
  Q q{0.f, 1.f, 1.f, 0.f};
  if (FMT == kFp8Expand) {
    q.c = __fmul_rn(__fsqrt_rn(mx), __fsqrt_rn(mn));
    const float r = __fdiv_rn(mx, mn);
    const bool hi = sub & Q4;
    const float l = log2f(hi ? q.c : r), lo = shfl<Q4>(l);
    const float log2r = hi ? lo : l, log2c = hi ? l : lo;
    float k = __fdiv_rn(floorf(__fdiv_rn(A.k16, log2r)), 16.f);  // k16 / 0 = inf: capped next
    q.k = fminf(fmaxf(k, 0.0625f), A.kmax);  // 1/16 when R overflows fp32 (k = 0), the cap when R = 1
    q.s = __fdiv_rn(powf(__fdiv_rn(mx, q.c), q.k), 448.f);
    q.a = __fadd_rn(__fmul_rn(q.k, log2c), log2f(q.s));
  } else {
    q.s = __fdiv_rn(mx, 448.f);
  }
  return q;
}

// log2|x| as fp8_adam.log2_lut: exponent + T0 + T1 * (low 13 mantissa bits as the fp32 (1 + low13 2^-23) - 1),
// each an fp32 operation in the reference's order; -inf for zeros and denormals.
__device__ __forceinline__ float log2_lut(float x, const float2* tab) {
  const uint32_t b = __float_as_uint(x) & 0x7FFFFFFFu;
  const float2 t = tab[(b >> (23 - kSegmentBits)) & (kLog2Segments - 1)];
  const float f = __fsub_rn(__uint_as_float((b & ((1u << (23 - kSegmentBits)) - 1)) | 0x3F800000u), 1.f);
  const float e = __fsub_rn(__uint_as_float((b >> 23) | 0x4B000000u), 8388735.f);  // (2^23 + e8) - (2^23 + 127)
  const float lg = __fadd_rn(__fadd_rn(__fmul_rn(t.y, f), t.x), e);
  return b < 0x00800000u ? -CUDART_INF_F : lg;
}

// The E4M3 code of x before the final conversion, which saturates (cvt.rn.satfinite: +-inf and
// |y| > 448 become +-448, exactly the reference's clamp to +-448; no clamp instructions here).
template <int FMT>
__device__ __forceinline__ float quant(float x, const Q& q, const float2* lg_tab) {
  if (FMT == kFp8Expand) {
    // log2(0) = -inf -> exp2 -> 0: zeros stay zero. The reference multiplies by sign(x); negating
    // where x < 0 gives the same code (e >= 0; x = +-0: e is 0), one instruction instead of four.
    const float e = exp2_ftz(__fsub_rn(__fmul_rn(q.k, log2_lut(x, lg_tab)), q.a));
    return x < 0.f ? -e : e;
  }
  return __fdiv_rn(x, q.s);
}

// The chunk holding group g, looked up only when g leaves the current one (a lane's groups only
// grow: usually no search at all).
template <typename G>
struct ChunkCursor {
  int idx = -1;
  int64_t start = 0, end = 0, numel = 0;
  const G* grad = nullptr;
  __nv_bfloat16* weight = nullptr;
  bool grad_vec = false, weight_vec = false;  // aligned for 4-element vector accesses

  __device__ __forceinline__ void seek(const Args& A, int64_t g) {
    if (g < end) return;
    int lo = idx + 1, hi = A.nchunks - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (A.group_start[mid] <= g) lo = mid; else hi = mid - 1;
    }
    idx = lo;
    start = A.group_start[lo];
    end = A.group_start[lo + 1];
    numel = A.numel[lo];
    grad = reinterpret_cast<const G*>(A.grad_ptr[lo]);
    weight = reinterpret_cast<__nv_bfloat16*>(A.weight_ptr[lo]);
    grad_vec = reinterpret_cast<uintptr_t>(grad) % (4 * sizeof(G)) == 0;
    weight_vec = reinterpret_cast<uintptr_t>(weight) % 8 == 0;
  }
};

// Where a lane's work in unit u lies (the last unit's slots past the shard's end work on the last group
// and store nothing: the shuffles need every lane).
struct Where {
  int64_t g, e, local, rem;  // group; first element in the shard, in its chunk; gradient elements from there
  bool valid;
};

template <typename G, typename V>
__device__ __forceinline__ Where locate(const Args& A, ChunkCursor<G>& chunk, int64_t u, int slot, int sub) {
  Where w;
  const int64_t g_slot = u * V::kGroupsPerWarp + slot;
  w.valid = g_slot < A.num_groups;
  w.g = w.valid ? g_slot : A.num_groups - 1;
  chunk.seek(A, w.g);
  w.e = w.g * kGroup + sub * 4;
  w.local = (w.g - chunk.start) * kGroup + sub * 4;
  w.rem = chunk.numel - w.local;
  return w;
}

// Whether the lane's gradient runs are all inside the chunk and aligned for vector loads (every lane but
// those at a chunk's end and those of a misaligned gradient).
template <typename G, typename V>
__device__ __forceinline__ bool grad_vectors(const ChunkCursor<G>& chunk, const Where& w) {
  return chunk.grad_vec && w.rem >= (V::kRuns - 1) * V::kRunStride + 4;
}

// ---- the pipeline (Config::kPipeline): cp.async copies global -> shared, 4, 8 or 16 bytes each
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  if (BYTES == 16)  // .cg: through L2 only (nothing here is read twice)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all_but_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// One pipeline stage of a block: every thread's copy of one unit, laid out [field][thread] so that the
// threads of a warp read consecutive 16-, 8- or 4-byte slots (no bank conflicts).
template <typename G, typename V>
struct Stage {
  float4 master[V::kRuns][kThreads];
  typename GradBits<G, V::kPerLane>::Vec grad[V::kRuns][kThreads];
  uint32_t mq[V::kRuns][kThreads], vq[V::kRuns][kThreads];  // FP8 codes, 4 per run
  float nums[4][kThreads];  // expansion: the lane's moment's s, k, c; absmax: m's s, v's s; [3]: the decay word
};

// Shared memory a launch needs beyond the static tables: two stages when pipelined.
template <typename G, typename V>
__host__ __device__ constexpr int pipeline_bytes() { return V::kPipeline ? 2 * (int)sizeof(Stage<G, V>) : 0; }

// Issue the copies of the lane's part of a unit (no wait). The decay flag comes as the aligned 4-byte word
// that holds it (cp.async copies 4 bytes at least; the word stays inside the flag tensor's allocation).
template <int FMT, typename G, typename V>
__device__ __forceinline__ void copy_unit(const Args& A, const ChunkCursor<G>& chunk, const Where& w,
                                          Stage<G, V>& st, int tid, bool is_v) {
  constexpr bool EXPAND = FMT == kFp8Expand;
#pragma unroll
  for (int j = 0; j < V::kRuns; ++j) {
    const int64_t o = w.e + j * V::kRunStride;
    cp_async<16>(&st.master[j][tid], A.master + o);
    cp_async<4>(&st.mq[j][tid], static_cast<const uint8_t*>(A.m.data) + o);
    cp_async<4>(&st.vq[j][tid], static_cast<const uint8_t*>(A.v.data) + o);
  }
  if (grad_vectors<G, V>(chunk, w)) {
#pragma unroll
    for (int j = 0; j < V::kRuns; ++j)
      cp_async<(int)sizeof(typename GradBits<G, V::kPerLane>::Vec)>(&st.grad[j][tid], chunk.grad + w.local + j * V::kRunStride);
  }
  if (EXPAND) {
    const Moment& M = is_v ? A.v : A.m;
    cp_async<4>(&st.nums[0][tid], M.s + w.g);
    cp_async<4>(&st.nums[1][tid], M.k + w.g);
    cp_async<4>(&st.nums[2][tid], M.c + w.g);
  } else {
    cp_async<4>(&st.nums[0][tid], A.m.s + w.g);
    cp_async<4>(&st.nums[1][tid], A.v.s + w.g);
  }
  cp_async<4>(&st.nums[3][tid], reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(A.decay + w.g) & ~uintptr_t(3)));
}

template <int FMT, typename G, typename V>
__global__ void __launch_bounds__(kThreads, V::kMinBlocks) adamw_kernel(const Args A) {
  constexpr bool FP8 = FMT == kFp8 || FMT == kFp8Expand, EXPAND = FMT == kFp8Expand;
  constexpr bool PIPE = V::kPipeline;
  static_assert(!PIPE || FP8, "the pipeline copies FP8 moments");
  constexpr int kLanes = V::kLanes, kRuns = V::kRuns;
  constexpr int kPerLane = V::kPerLane, kRunStride = V::kRunStride;
  constexpr int kHalf = kLanes / 2, kQuarter = kLanes / 4;  // partner (other moment), log2 split
  if (*A.found_inf != 0.f) return;  // skipped step: nothing changes (uniform over the block)
  __shared__ float2 tab[EXPAND ? 256 : 1];
  __shared__ float2 lg_tab[EXPAND ? kLog2Segments : 1];
  extern __shared__ __align__(16) unsigned char pipeline_smem[];  // two Stages when PIPE
  if (EXPAND) {  // log2f of every E4M3 magnitude (the fp32 values torch.log2 gives) and the code's sign
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      const uint32_t mag = i & 0x7f;
      tab[i] = make_float2(log2f(fp8_to_float(mag)), mag == 0 ? 0.f : ((i & 0x80) ? -1.f : 1.f));
    }
    for (int i = threadIdx.x; i < kLog2Segments; i += blockDim.x) lg_tab[i] = A.log2_tab[i];
    __syncthreads();
  }
  const float t = __fadd_rn(*A.step, 1.f);
  const float bc1 = __fsub_rn(1.f, powf(A.b1, t));
  const float bc2 = __fsqrt_rn(__fsub_rn(1.f, powf(A.b2, t)));
  // sqrt(v) / bc2 by Markstein's correction with the reciprocal rounded once: q0 = a * r, q = q0 + (a - q0 bc2) r
  // (two fmas) is the correctly rounded quotient, the same bits as the division (checked against exact
  // rationals in tests/test_fp8_adam.py), for bc2 = sqrt(1 - b2^t) in (0, 1] (the config keeps beta2 < 1).
  const float rbc2 = __frcp_rn(bc2);
  const float coeff = *A.coeff;
  const int tid = threadIdx.x, lane = tid & 31, slot = lane / kLanes, sub = lane % kLanes;
  const bool is_v = sub >= kLanes / 2;  // the moment whose per-group numbers this lane computes
  const int64_t units = (A.num_groups + V::kGroupsPerWarp - 1) / V::kGroupsPerWarp;
  const int64_t nwarps = (int64_t)gridDim.x * kWarpsPerBlock;
  const int64_t first = (int64_t)blockIdx.x * kWarpsPerBlock + (tid >> 5);
  ChunkCursor<G> chunk;
  ChunkCursor<G> ahead;  // PIPE: the chunk of the unit being copied in
  Stage<G, V>* stages = reinterpret_cast<Stage<G, V>*>(pipeline_smem);
  if (PIPE) {
    if (first < units) copy_unit<FMT, G, V>(A, ahead, locate<G, V>(A, ahead, first, slot, sub), stages[0], tid, is_v);
    cp_async_commit();
  }
  int stage = 0;
  for (int64_t u = first; u < units; u += nwarps, stage ^= 1) {
    const Where w = locate<G, V>(A, chunk, u, slot, sub);
    const int64_t g = w.g, e = w.e, local = w.local, rem = w.rem;
    const bool valid = w.valid;

    // ---- loads: everything this lane needs, issued before any arithmetic (PIPE: the next unit's copies
    // issued, this unit's waited for and read back from shared memory)
    float p[kPerLane], m[kPerLane], v[kPerLane];
    GradBits<G, kPerLane> gr;
    uint32_t mq[kRuns], vq[kRuns];  // FP8 codes, 4 per run
    float nums[3] = {0.f, 0.f, 0.f};  // PIPE: the per-group numbers as copied (see Stage::nums)
    uint32_t decay_word = 0;
    const bool vec_grad = grad_vectors<G, V>(chunk, w);
    if (PIPE) {
      const int64_t next = u + nwarps;
      if (next < units)
        copy_unit<FMT, G, V>(A, ahead, locate<G, V>(A, ahead, next, slot, sub), stages[stage ^ 1], tid, is_v);
      cp_async_commit();  // (an empty group past the last unit: the wait below stays the same)
      cp_async_wait_all_but_one();
      const Stage<G, V>& st = stages[stage];
#pragma unroll
      for (int j = 0; j < kRuns; ++j) {
        const float4 d = st.master[j][tid];
        p[4 * j] = d.x; p[4 * j + 1] = d.y; p[4 * j + 2] = d.z; p[4 * j + 3] = d.w;
        mq[j] = st.mq[j][tid];
        vq[j] = st.vq[j][tid];
        if (vec_grad) gr.set4(st.grad[j][tid], j);
      }
      nums[0] = st.nums[0][tid];
      nums[1] = st.nums[1][tid];
      if (EXPAND) nums[2] = st.nums[2][tid];  // absmax copies no third number
      decay_word = __float_as_uint(st.nums[3][tid]);
    } else {
#pragma unroll
      for (int j = 0; j < kRuns; ++j) {
        const float4 d = *reinterpret_cast<const float4*>(A.master + e + j * kRunStride);
        p[4 * j] = d.x; p[4 * j + 1] = d.y; p[4 * j + 2] = d.z; p[4 * j + 3] = d.w;
      }
#pragma unroll
      for (int j = 0; j < kRuns; ++j) {
        const int64_t o = e + j * kRunStride;
        if (FP8) {
          mq[j] = *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(A.m.data) + o);
          vq[j] = *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(A.v.data) + o);
        } else if (FMT == kBf16) {
          bf16x4_to_float(*reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(A.m.data) + o), m + 4 * j);
          bf16x4_to_float(*reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(A.v.data) + o), v + 4 * j);
        } else {
          const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(A.m.data) + o);
          const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(A.v.data) + o);
          m[4 * j] = a.x; m[4 * j + 1] = a.y; m[4 * j + 2] = a.z; m[4 * j + 3] = a.w;
          v[4 * j] = b.x; v[4 * j + 1] = b.y; v[4 * j + 2] = b.z; v[4 * j + 3] = b.w;
        }
      }
    }
    const float wd = (PIPE ? (decay_word >> (8 * (reinterpret_cast<uintptr_t>(A.decay + g) & 3))) & 0xff : A.decay[g])
                         ? A.wd : 0.f;
    // Gradients: zeros past the chunk's end; vector loads where the whole lane's runs are inside and
    // aligned (PIPE: those came with the copies).
    if (vec_grad) {
      if (!PIPE) {
#pragma unroll
        for (int j = 0; j < kRuns; ++j) {
          gr.load4(chunk.grad + local + j * kRunStride, j);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int o = (i / 4) * kRunStride + i % 4;
        gr.load1(chunk.grad + local + o, i, o < rem);
      }
    }
    // Per-group numbers of the stored moments: each lane computes them for one moment (is_v),
    // its partner 4 lanes away for the other (absmax: only s, read directly).
    Dq dm{1.f, 0.f, 1.f}, dv{1.f, 0.f, 1.f};
    if (FMT == kFp8) {
      dm.s = PIPE ? nums[0] : A.m.s[g];
      dv.s = PIPE ? nums[1] : A.v.s[g];
    } else if (EXPAND) {
      const Moment& M = is_v ? A.v : A.m;
      const Dq mine = PIPE ? dequant_params<kQuarter>(nums[0], nums[1], nums[2], sub)
                           : dequant_params<kQuarter>(M.s[g], M.k[g], M.c[g], sub);
      const Dq other{shfl<kHalf>(mine.inv_k), shfl<kHalf>(mine.s), shfl<kHalf>(mine.c)};
      dm = is_v ? other : mine;
      dv = is_v ? mine : other;
    }
    if (FP8) {
#pragma unroll
      for (int j = 0; j < kRuns; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          m[4 * j + i] = dequant<FMT>(mq[j] >> (8 * i), dm, tab);
          v[4 * j + i] = dequant<FMT>(vq[j] >> (8 * i), dv, tab);
        }
    }

    // ---- AdamW, the reference's operations in its order
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float gg = __fmul_rn(gr[i], coeff);
      m[i] = __fadd_rn(__fmul_rn(m[i], A.b1), __fmul_rn(gg, A.ob1));
      v[i] = __fadd_rn(__fmul_rn(v[i], A.b2), __fmul_rn(__fmul_rn(gg, A.ob2), gg));
      float update;
      if (V::kFastUpdate) {  // the reference's operations, its sqrt and two divisions approximated
        const float denom = __fmul_rn(__fadd_rn(__fmul_rn(sqrt_approx(v[i]), rbc2), A.eps), bc1);
        update = __fadd_rn(__fmul_rn(m[i], rcp_approx(denom)), __fmul_rn(p[i], wd));
      } else {
        const float sv = __fsqrt_rn(v[i]);
        const float q0 = __fmul_rn(sv, rbc2);
        // == __fdiv_rn(sv, bc2); an infinite v (a gradient square beyond fp32, clipping off) divides to inf, as
        // there, where the correction would make inf - inf = NaN
        const float sq = isinf(sv) ? sv : __fmaf_rn(__fmaf_rn(-q0, bc2, sv), rbc2, q0);
        const float denom = __fmul_rn(__fadd_rn(sq, A.eps), bc1);
        update = __fadd_rn(__fdiv_rn(m[i], denom), __fmul_rn(p[i], wd));
      }
      p[i] = __fsub_rn(p[i], __fmul_rn(update, A.lr));
    }
    if (valid) {
#pragma unroll
      for (int j = 0; j < kRuns; ++j)
        *reinterpret_cast<float4*>(A.master + e + j * kRunStride) =
            make_float4(p[4 * j], p[4 * j + 1], p[4 * j + 2], p[4 * j + 3]);
      if (chunk.weight != nullptr) {
        if (chunk.weight_vec && rem >= (kRuns - 1) * kRunStride + 4) {
#pragma unroll
          for (int j = 0; j < kRuns; ++j)
            *reinterpret_cast<uint2*>(chunk.weight + local + j * kRunStride) = float4_to_bf16x4(p + 4 * j);
        } else {
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) {
            const int o = (i / 4) * kRunStride + i % 4;
            if (o < rem) chunk.weight[local + o] = __float2bfloat16_rn(p[i]);
          }
        }
      }
    }

    // ---- the moments back to their format
    if (!FP8) {
      if (valid) {
#pragma unroll
        for (int j = 0; j < kRuns; ++j) {
          const int64_t o = e + j * kRunStride;
          if (FMT == kBf16) {
            *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(A.m.data) + o) = float4_to_bf16x4(m + 4 * j);
            *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(A.v.data) + o) = float4_to_bf16x4(v + 4 * j);
          } else {
            *reinterpret_cast<float4*>(static_cast<float*>(A.m.data) + o) =
                make_float4(m[4 * j], m[4 * j + 1], m[4 * j + 2], m[4 * j + 3]);
            *reinterpret_cast<float4*>(static_cast<float*>(A.v.data) + o) =
                make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
          }
        }
      }
      continue;
    }
    // Group max and true nonzero min of |m| and |v|: over the lane's elements, then across the
    // group's lanes. The first exchange (LANES/2 apart) also splits the work: the lower half keeps
    // m's values and the upper half v's, so each lane ends with one moment's pair.
    float mx_m = 0.f, mn_m = CUDART_INF_F, mx_v = 0.f, mn_v = CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float a = fabsf(m[i]), b = fabsf(v[i]);
      mx_m = fmaxf(mx_m, a);
      mx_v = fmaxf(mx_v, b);
      if (a > 0.f) mn_m = fminf(mn_m, a);  // the true nonzero minimum: zeros never enter
      if (b > 0.f) mn_v = fminf(mn_v, b);
    }
    float mx = fmaxf(is_v ? mx_v : mx_m, shfl<kHalf>(is_v ? mx_m : mx_v));
    float mn = fminf(is_v ? mn_v : mn_m, shfl<kHalf>(is_v ? mn_m : mn_v));
#pragma unroll
    for (int off = kQuarter; off > 0; off >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    }
    const Q mine = group_stats<FMT, kQuarter>(mx, mn, A, sub);
    Q other = mine;
    if (EXPAND) {  // quant needs k and a
      other.k = shfl<kHalf>(mine.k);
      other.a = shfl<kHalf>(mine.a);
    } else {
      other.s = shfl<kHalf>(mine.s);
    }
    const Q qm = is_v ? other : mine, qv = is_v ? mine : other;
    if (valid) {
#pragma unroll
      for (int j = 0; j < kRuns; ++j) {
        const int i = 4 * j;
        const int64_t o = e + j * kRunStride;
        const uint32_t cm = float2_to_fp8x2(quant<FMT>(m[i], qm, lg_tab), quant<FMT>(m[i + 1], qm, lg_tab)) |
                            float2_to_fp8x2(quant<FMT>(m[i + 2], qm, lg_tab), quant<FMT>(m[i + 3], qm, lg_tab)) << 16;
        const uint32_t cv = float2_to_fp8x2(quant<FMT>(v[i], qv, lg_tab), quant<FMT>(v[i + 1], qv, lg_tab)) |
                            float2_to_fp8x2(quant<FMT>(v[i + 2], qv, lg_tab), quant<FMT>(v[i + 3], qv, lg_tab)) << 16;
        *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(A.m.data) + o) = cm;
        *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(A.v.data) + o) = cv;
      }
      if (sub % kHalf == 0) {  // lane 0 of the group writes m's numbers, lane LANES/2 v's
        const Moment& M = is_v ? A.v : A.m;
        M.s[g] = mine.s;
        if (EXPAND) {
          M.k[g] = mine.k;
          M.c[g] = mine.c;
        }
      }
    }
  }
}

#define RETURN_IF_ERROR(call)                \
  do {                                       \
    const cudaError_t err_ = (call);         \
    if (err_ != cudaSuccess) return err_;    \
  } while (0)

template <int FMT, typename G>
cudaError_t launch(const Args& A, cudaStream_t stream) {
  using V = typename ConfigFor<FMT>::type;
  if (A.num_groups == 0) return cudaSuccess;
  constexpr int smem = pipeline_bytes<G, V>();
  // Opt in to the pipeline's dynamic shared memory: static + dynamic above 48 KiB needs it (88 KiB here).
  // At every launch: the attribute belongs to the current device, and it is cheap.
  if (smem > 0)
    RETURN_IF_ERROR(cudaFuncSetAttribute(adamw_kernel<FMT, G, V>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Persistent grid: the blocks that fit on the GPU at once (fewer for a small shard). Asked once per
  // kernel (the first device's answer kept: one GPU model per process).
  static int per_sm = 0;
  if (per_sm == 0) {
    int n = 0;
    RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, adamw_kernel<FMT, G, V>, kThreads, smem));
    per_sm = std::max(n, 1);
  }
  int dev = 0, sms = 0;
  RETURN_IF_ERROR(cudaGetDevice(&dev));
  RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t units = (A.num_groups + V::kGroupsPerWarp - 1) / V::kGroupsPerWarp;
  const int64_t blocks = std::min<int64_t>((units + kWarpsPerBlock - 1) / kWarpsPerBlock, (int64_t)per_sm * sms);
  adamw_kernel<FMT, G, V><<<(unsigned)blocks, kThreads, smem, stream>>>(A);
  return cudaGetLastError();
}

template <int FMT>
cudaError_t launch_for_grad(const Args& A, bool bf16_grad, cudaStream_t stream) {
  return bf16_grad ? launch<FMT, __nv_bfloat16>(A, stream) : launch<FMT, float>(A, stream);
}

}  // namespace

cudaError_t launch_adamw_step(const Args& A, int fmt, bool grad_is_bf16, cudaStream_t stream) {
  switch (fmt) {
    case kFp32: return launch_for_grad<kFp32>(A, grad_is_bf16, stream);
    case kBf16: return launch_for_grad<kBf16>(A, grad_is_bf16, stream);
    case kFp8: return launch_for_grad<kFp8>(A, grad_is_bf16, stream);
    case kFp8Expand: return launch_for_grad<kFp8Expand>(A, grad_is_bf16, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace megacoat_adamw
