// Fused AdamW step over a whole flat optimizer shard, with Adam moments in fp32, bf16 or COAT's
// FP8 (E4M3 groups of 128 with per-group scale s, exponent k, centre c; DESIGN 5.4), writing the
// updated bf16 weight in the same pass. One launch for the shard: one warp per group of 128
// elements, 4 contiguous elements per lane (16-byte master loads), butterfly shuffles for the
// group max and the true nonzero min.
//
// Numerics: the torch reference `megacoat.optim.fp8_adam.reference_step` is the specification.
// Every fp32 operation here is the same IEEE-rounded operation in the same order (explicit __f*_rn
// intrinsics: no FMA contraction, no fast math), pow/log2/exp2 are CUDA's powf/log2f/exp2f, which
// torch's fp32 pow/log2/exp2 call on the GPU; so kernel and reference agree bit for bit. Build
// WITHOUT --use_fast_math (it would swap them for the approximate intrinsics and flush denormals).
//
// The skip flag, the clip factor and the step count are read from device memory: the host never
// waits. A skipped step (found_inf != 0) returns before touching anything.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

namespace {

constexpr int kGroup = 128;
constexpr int kWarpsPerBlock = 8;

// kFp8Expand: COAT's form, (|x|/c)^k / s with powf and two divisions per element (reproduces COAT's
// codes); kFp8ExpandFast: the same statistics, codes as exp2(k log2|x| - (k log2 c + log2 s)) and
// values as exp2((log2|q| + log2 s) / k + log2 c) with log2|q| from a 128-entry table: per element
// and moment one log2f and two exp2f instead of two powf and two divisions (about 5x fewer
// instructions; the kernel was compute-bound).
enum Format : int { kFp32 = 0, kBf16 = 1, kFp8 = 2, kFp8Expand = 3, kFp8ExpandFast = 4 };

struct Moment {
  void* data;   // float / bf16 / uint8 codes, one per element
  float* s;     // per group (fp8 only)
  float* k;
  float* c;
};

struct Args {
  float* master;
  // Chunks: runs of whole groups of the shard, each with its own gradient (float or bf16) and
  // optional bf16 weight tensor of `numel` elements (the rest of its last group is padding).
  const int64_t* group_start;     // [nchunks + 1]
  const int64_t* grad_ptr;        // [nchunks] addresses
  const int64_t* weight_ptr;      // [nchunks] addresses, 0: no weight to write
  const int64_t* numel;           // [nchunks]
  int nchunks;
  const uint8_t* decay;           // per group: 1 = weight decay applies
  Moment m, v;
  const float* step;              // successful steps so far
  const float* found_inf;
  const float* coeff;             // clip factor
  float lr, b1, ob1, b2, ob2, eps, wd, k16, kmax, tiny;
  int64_t num_groups;
};

__device__ __forceinline__ float sign_of(float x) {
  return (float)(x > 0.f) - (float)(x < 0.f);  // as the reference: 0 for +-0
}

__device__ __forceinline__ float fp8_to_float(uint8_t b) {
  __nv_fp8_e4m3 q;
  q.__x = b;
  return float(q);
}

__device__ __forceinline__ uint8_t float_to_fp8(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

template <int FMT>
struct MomentIO;

template <>
struct MomentIO<kFp32> {
  __device__ static void load(const Moment& M, int64_t g, int64_t e, float x[4], const float*) {
    float4 d = *reinterpret_cast<const float4*>(static_cast<const float*>(M.data) + e);
    x[0] = d.x; x[1] = d.y; x[2] = d.z; x[3] = d.w;
  }
  __device__ static void store(const Moment& M, const Args&, int64_t g, int64_t e, const float x[4], int lane) {
    *reinterpret_cast<float4*>(static_cast<float*>(M.data) + e) = make_float4(x[0], x[1], x[2], x[3]);
  }
};

template <>
struct MomentIO<kBf16> {
  __device__ static void load(const Moment& M, int64_t g, int64_t e, float x[4], const float*) {
    uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(M.data) + e);
    __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&raw.x);
    __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&raw.y);
    x[0] = __low2float(a); x[1] = __high2float(a); x[2] = __low2float(b); x[3] = __high2float(b);
  }
  __device__ static void store(const Moment& M, const Args&, int64_t g, int64_t e, const float x[4], int lane) {
    uint2 raw;
    __nv_bfloat162 a = __halves2bfloat162(__float2bfloat16_rn(x[0]), __float2bfloat16_rn(x[1]));
    __nv_bfloat162 b = __halves2bfloat162(__float2bfloat16_rn(x[2]), __float2bfloat16_rn(x[3]));
    raw.x = *reinterpret_cast<uint32_t*>(&a);
    raw.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(M.data) + e) = raw;
  }
};

// FP8 groups; EXPAND selects COAT's dynamic range expansion (else k = 1, c = 1, s = absmax / 448),
// FAST its exp2/log2 form (see Format). `lq`: log2f of the 128 E4M3 magnitudes (FAST only).
template <bool EXPAND, bool FAST = false>
struct Fp8IO {
  __device__ static void load(const Moment& M, int64_t g, int64_t e, float x[4], const float* lq) {
    uint32_t codes = *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(M.data) + e);
    const float s = M.s[g];
    if (FAST) {
      const float inv_k = __fdiv_rn(1.f, M.k[g]), ls = log2f(s), lc = log2f(M.c[g]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t b = (codes >> (8 * i)) & 0xff, mag = b & 0x7f;
        const float sign = mag == 0 ? 0.f : ((b & 0x80) ? -1.f : 1.f);   // sign of the code's value
        x[i] = __fmul_rn(sign, exp2f(__fadd_rn(__fmul_rn(__fadd_rn(lq[mag], ls), inv_k), lc)));
      }
      return;
    }
    float inv_k = 1.f, c = 1.f;
    if (EXPAND) {
      inv_k = __fdiv_rn(1.f, M.k[g]);
      c = M.c[g];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float y = __fmul_rn(fp8_to_float((codes >> (8 * i)) & 0xff), s);
      if (EXPAND) y = __fmul_rn(__fmul_rn(sign_of(y), powf(fabsf(y), inv_k)), c);
      x[i] = y;
    }
  }

  __device__ static void store(const Moment& M, const Args& A, int64_t g, int64_t e, const float x[4], int lane) {
    float mx = 0.f, mn = CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float a = fabsf(x[i]);
      mx = fmaxf(mx, a);
      if (a > 0.f) mn = fminf(mn, a);  // the true nonzero minimum: zeros never enter
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {  // butterfly: every lane ends with the group's values
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    }
    mx = __fadd_rn(mx, A.tiny);
    mn = __fadd_rn(isinf(mn) ? 0.f : mn, A.tiny);
    float s, k = 1.f, c = 1.f;
    if (EXPAND) {
      c = __fmul_rn(__fsqrt_rn(mx), __fsqrt_rn(mn));
      const float log2r = log2f(__fdiv_rn(mx, mn));
      k = __fdiv_rn(floorf(__fdiv_rn(A.k16, log2r)), 16.f);  // k16 / 0 = inf: capped next
      k = fminf(fmaxf(k, 0.0625f), A.kmax);  // 1/16 when R overflows fp32 (k = 0), the cap when R = 1
      s = __fdiv_rn(powf(__fdiv_rn(mx, c), k), 448.f);
    } else {
      s = __fdiv_rn(mx, 448.f);
    }
    uint32_t codes = 0;
    if (FAST) {
      const float a = __fadd_rn(__fmul_rn(k, log2f(c)), log2f(s));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // log2(0) = -inf -> exp2 -> 0: zeros stay zero
        float y = __fmul_rn(sign_of(x[i]), exp2f(__fsub_rn(__fmul_rn(k, log2f(fabsf(x[i]))), a)));
        y = fminf(fmaxf(y, -448.f), 448.f);
        codes |= (uint32_t)float_to_fp8(y) << (8 * i);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float y = x[i];
        if (EXPAND) y = __fmul_rn(sign_of(y), powf(__fdiv_rn(fabsf(y), c), k));
        y = fminf(fmaxf(__fdiv_rn(y, s), -448.f), 448.f);
        codes |= (uint32_t)float_to_fp8(y) << (8 * i);
      }
    }
    *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(M.data) + e) = codes;
    if (lane == 0) {
      M.s[g] = s;
      if (EXPAND) {
        M.k[g] = k;
        M.c[g] = c;
      }
    }
  }
};

template <>
struct MomentIO<kFp8> : Fp8IO<false> {};
template <>
struct MomentIO<kFp8Expand> : Fp8IO<true> {};
template <>
struct MomentIO<kFp8ExpandFast> : Fp8IO<true, true> {};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// 4 gradients from element `i` of a chunk of n elements (zeros past its end). bf16 gradients are
// widened in registers: no fp32 copy of a bf16 gradient buffer exists.
template <typename G>
__device__ __forceinline__ void load_grad(const G* grad, int64_t i, int64_t n, float g[4]) {
  const G* ptr = grad + i;
  if (i + 4 <= n && reinterpret_cast<uintptr_t>(ptr) % (4 * sizeof(G)) == 0) {
    if (sizeof(G) == 4) {
      float4 d = *reinterpret_cast<const float4*>(ptr);
      g[0] = d.x; g[1] = d.y; g[2] = d.z; g[3] = d.w;
    } else {
      uint2 raw = *reinterpret_cast<const uint2*>(ptr);
      __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&raw.x);
      __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&raw.y);
      g[0] = __low2float(a); g[1] = __high2float(a); g[2] = __low2float(b); g[3] = __high2float(b);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) g[j] = i + j < n ? to_float(ptr[j]) : 0.f;
}

__device__ __forceinline__ void store_weight(__nv_bfloat16* w, int64_t i, int64_t n, const float p[4]) {
  __nv_bfloat16* ptr = w + i;
  if (i + 4 <= n && reinterpret_cast<uintptr_t>(ptr) % 8 == 0) {
    uint2 raw;
    __nv_bfloat162 a = __halves2bfloat162(__float2bfloat16_rn(p[0]), __float2bfloat16_rn(p[1]));
    __nv_bfloat162 b = __halves2bfloat162(__float2bfloat16_rn(p[2]), __float2bfloat16_rn(p[3]));
    raw.x = *reinterpret_cast<uint32_t*>(&a);
    raw.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(ptr) = raw;
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (i + j < n) ptr[j] = __float2bfloat16_rn(p[j]);
}

template <int FMT, typename G, bool WRITE_WEIGHT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) adamw_kernel(const Args A) {
  if (*A.found_inf != 0.f) return;  // skipped step: nothing changes (uniform over the block)
  __shared__ float lq[FMT == kFp8ExpandFast ? 128 : 1];
  if (FMT == kFp8ExpandFast) {  // log2f of every E4M3 magnitude: the same fp32 values torch.log2 gives
    for (int i = threadIdx.x; i < 128; i += blockDim.x) lq[i] = log2f(fp8_to_float((uint8_t)i));
    __syncthreads();
  }
  const float t = __fadd_rn(*A.step, 1.f);
  const float bc1 = __fsub_rn(1.f, powf(A.b1, t));
  const float bc2 = __fsqrt_rn(__fsub_rn(1.f, powf(A.b2, t)));
  const float coeff = *A.coeff;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t)gridDim.x * kWarpsPerBlock;
  for (int64_t gi = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); gi < A.num_groups; gi += nwarps) {
    int lo = 0, hi = A.nchunks - 1;  // the chunk holding group gi (few chunks: buckets)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (A.group_start[mid] <= gi) lo = mid; else hi = mid - 1;
    }
    const int64_t e = gi * kGroup + lane * 4;
    const int64_t local = (gi - A.group_start[lo]) * kGroup + lane * 4;  // element within the chunk
    const int64_t n = A.numel[lo];
    float4 p4 = *reinterpret_cast<const float4*>(A.master + e);
    float p[4] = {p4.x, p4.y, p4.z, p4.w};
    float g[4], m[4], v[4];
    load_grad<G>(reinterpret_cast<const G*>(A.grad_ptr[lo]), local, n, g);
    MomentIO<FMT>::load(A.m, gi, e, m, lq);
    MomentIO<FMT>::load(A.v, gi, e, v, lq);
    const float wd = A.decay[gi] ? A.wd : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float gg = __fmul_rn(g[i], coeff);
      m[i] = __fadd_rn(__fmul_rn(m[i], A.b1), __fmul_rn(gg, A.ob1));
      v[i] = __fadd_rn(__fmul_rn(v[i], A.b2), __fmul_rn(__fmul_rn(gg, A.ob2), gg));
      const float denom = __fmul_rn(__fadd_rn(__fdiv_rn(__fsqrt_rn(v[i]), bc2), A.eps), bc1);
      const float update = __fadd_rn(__fdiv_rn(m[i], denom), __fmul_rn(p[i], wd));
      p[i] = __fsub_rn(p[i], __fmul_rn(update, A.lr));
    }
    *reinterpret_cast<float4*>(A.master + e) = make_float4(p[0], p[1], p[2], p[3]);
    if (WRITE_WEIGHT && A.weight_ptr[lo] != 0)
      store_weight(reinterpret_cast<__nv_bfloat16*>(A.weight_ptr[lo]), local, n, p);
    MomentIO<FMT>::store(A.m, A, gi, e, m, lane);
    MomentIO<FMT>::store(A.v, A, gi, e, v, lane);
  }
}

template <int FMT, typename G, bool W>
void launch(const Args& A, cudaStream_t stream) {
  if (A.num_groups == 0) return;
  int64_t blocks = (A.num_groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
  blocks = blocks > (1 << 30) ? (1 << 30) : blocks;
  adamw_kernel<FMT, G, W><<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(A);
}

template <int FMT>
void dispatch_dtypes(const Args& A, bool bf16_grad, bool, cudaStream_t stream) {
  if (bf16_grad) launch<FMT, __nv_bfloat16, true>(A, stream); else launch<FMT, float, true>(A, stream);
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "megacoat fused_adamw: ", what); }

bool aligned16(const torch::Tensor& t) { return t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

Moment moment_of(torch::Tensor data, torch::Tensor s, torch::Tensor k, torch::Tensor c) {
  check(data.is_cuda() && data.is_contiguous() && aligned16(data), "moment data must be contiguous CUDA tensors");
  auto ptr = [](torch::Tensor t) { return t.numel() ? t.data_ptr<float>() : nullptr; };
  return Moment{data.data_ptr(), ptr(s), ptr(k), ptr(c)};
}

}  // namespace

void adamw_step(torch::Tensor master, torch::Tensor chunks, int64_t grad_is_bf16, torch::Tensor decay,
                torch::Tensor m_data, torch::Tensor m_s, torch::Tensor m_k, torch::Tensor m_c, torch::Tensor v_data,
                torch::Tensor v_s, torch::Tensor v_k, torch::Tensor v_c, int64_t fmt, torch::Tensor step,
                torch::Tensor found_inf, torch::Tensor coeff, double lr, double b1, double ob1, double b2, double ob2,
                double eps, double wd, double k16, double kmax, double tiny) {
  // chunks: int64 [4, nchunks + 1] on the device: group starts (nchunks + 1), gradient addresses,
  // weight addresses (0: none), element counts.
  check(master.is_cuda() && master.scalar_type() == at::kFloat && master.is_contiguous() && aligned16(master),
        "master must be a contiguous fp32 CUDA tensor");
  check(master.numel() % kGroup == 0, "the shard must hold whole groups of 128 elements");
  check(chunks.is_cuda() && chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(0) == 4 &&
        chunks.is_contiguous() && chunks.size(1) >= 2, "chunk table: int64 CUDA tensor [4, nchunks + 1]");
  check(decay.scalar_type() == at::kBool && decay.numel() == master.numel() / kGroup, "one decay flag per group");
  check(fmt >= 0 && fmt <= 4, "unknown moment format");
  const int64_t stride = chunks.size(1);
  const int64_t* table = chunks.data_ptr<int64_t>();
  Args A;
  A.master = master.data_ptr<float>();
  A.group_start = table;
  A.grad_ptr = table + stride;
  A.weight_ptr = table + 2 * stride;
  A.numel = table + 3 * stride;
  A.nchunks = (int)(stride - 1);
  A.decay = reinterpret_cast<const uint8_t*>(decay.data_ptr<bool>());
  A.m = moment_of(m_data, m_s, m_k, m_c);
  A.v = moment_of(v_data, v_s, v_k, v_c);
  A.step = step.data_ptr<float>();
  A.found_inf = found_inf.data_ptr<float>();
  A.coeff = coeff.data_ptr<float>();
  A.lr = (float)lr; A.b1 = (float)b1; A.ob1 = (float)ob1; A.b2 = (float)b2; A.ob2 = (float)ob2;
  A.eps = (float)eps; A.wd = (float)wd; A.k16 = (float)k16; A.kmax = (float)kmax; A.tiny = (float)tiny;
  A.num_groups = master.numel() / kGroup;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool bf16 = grad_is_bf16 != 0;
  switch (fmt) {  // weights are always written where a chunk has them (WRITE_WEIGHT: compile-time skip when none)
    case kFp32: dispatch_dtypes<kFp32>(A, bf16, true, stream); break;
    case kBf16: dispatch_dtypes<kBf16>(A, bf16, true, stream); break;
    case kFp8: dispatch_dtypes<kFp8>(A, bf16, true, stream); break;
    case kFp8Expand: dispatch_dtypes<kFp8Expand>(A, bf16, true, stream); break;
    default: dispatch_dtypes<kFp8ExpandFast>(A, bf16, true, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_step", &adamw_step, "Fused AdamW step over a flat shard (fp32/bf16/FP8 moments, bf16 weight out)");
}
