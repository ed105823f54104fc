// FP8 weight-gradient GEMM that adds into the fp32 main gradient in its epilogue (cuBLASLt, beta = 1):
//   out[N, K] (+)= (gqt[N, T] * sg) @ (xqt[K, T] * sx)^T
// torch._scaled_mm can write an fp32 output (`out=`) but cannot add to one, so without this every
// micro-batch after a step's first paid an fp32 temporary plus an add pass over the weight gradient
// (16 bytes per weight element; on the H200 1.8 ms per micro-batch at 1.36B, 11.7 ms at 7B, see
// benchmarks/results/2026-12-01_s6_h200.md). Megatron + TransformerEngine do the same through TE's
// GEMM with accumulate=True.
//
// Layout: every tensor is row-major. cuBLASLt is column-major and its FP8 GEMMs take only the "TN"
// form, so the product is written as out^T (column-major [K, N], ld K) = A^T B with A = xqt seen as
// column-major [T, K] (ld T, transposed) and B = gqt seen as column-major [T, N] (ld T): both operands
// are read K-major (T contiguous), which is what the FP8 tensor-core kernels want.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "megacoat fp8_wgrad: ", what); }

void check_lt(cublasStatus_t s, const char* call) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "megacoat fp8_wgrad: ", call, " failed with cuBLAS status ", (int)s);
}

cudaDataType_t fp8_type(const torch::Tensor& t) {
  if (t.scalar_type() == at::kFloat8_e4m3fn) return CUDA_R_8F_E4M3;
  check(t.scalar_type() == at::kFloat8_e5m2, "operands must be float8_e4m3fn or float8_e5m2");
  return CUDA_R_8F_E5M2;
}

uint32_t alignment(const void* p) {  // largest power of two (<= 256) dividing the address
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a) a /= 2;
  return a;
}

// RAII owners of the cuBLASLt descriptors (made per call: microseconds; the algorithm search is cached).
struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  MatmulDesc() { check_lt(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate"); }
  ~MatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
  template <typename T> void set(cublasLtMatmulDescAttributes_t a, const T& v) {
    check_lt(cublasLtMatmulDescSetAttribute(d, a, &v, sizeof(v)), "cublasLtMatmulDescSetAttribute");
  }
};

struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  Layout(cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld) {
    check_lt(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld), "cublasLtMatrixLayoutCreate");
  }
  ~Layout() { if (l) cublasLtMatrixLayoutDestroy(l); }
};

struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  Preference() { check_lt(cublasLtMatmulPreferenceCreate(&p), "cublasLtMatmulPreferenceCreate"); }
  ~Preference() { if (p) cublasLtMatmulPreferenceDestroy(p); }
  template <typename T> void set(cublasLtMatmulPreferenceAttributes_t a, const T& v) {
    check_lt(cublasLtMatmulPreferenceSetAttribute(p, a, &v, sizeof(v)), "cublasLtMatmulPreferenceSetAttribute");
  }
};

constexpr size_t kWorkspace = 32u << 20;  // cuBLAS's recommendation for Hopper

// The heuristic's choice per problem (a few layer shapes per model): asking it costs more host time
// than the launch itself.
using Key = std::tuple<int64_t, int64_t, int64_t, int, int, uint32_t, uint32_t, uint32_t, bool, bool, int>;
std::map<Key, cublasLtMatmulAlgo_t> algo_cache;
std::mutex algo_mutex;

bool is_fp8(const torch::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

// Whether the cuBLASLt FP8 GEMM takes the problem: the caller runs its fallback where it does not. Checked
// here rather than in Python: this runs on every micro-batch of every linear, where Python's checks cost
// more host time than the launch (H200 host profile, 2026-12-01).
bool takes(const torch::Tensor& out, const torch::Tensor& gqt, const torch::Tensor& sg, const torch::Tensor& xqt,
           const torch::Tensor& sx) {
  if (!(out.is_cuda() && gqt.is_cuda() && xqt.is_cuda() && sg.is_cuda() && sx.is_cuda())) return false;
  const auto dev = out.get_device();
  if (gqt.get_device() != dev || xqt.get_device() != dev || sg.get_device() != dev || sx.get_device() != dev) return false;
  if (!(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous())) return false;
  if (!(gqt.dim() == 2 && xqt.dim() == 2 && gqt.is_contiguous() && xqt.is_contiguous())) return false;
  if (!(is_fp8(gqt) && is_fp8(xqt))) return false;
  if (gqt.scalar_type() == at::kFloat8_e5m2 && xqt.scalar_type() == at::kFloat8_e5m2) return false;  // no such kernel
  const int64_t n = gqt.size(0), k = xqt.size(0), t = gqt.size(1);
  if (!(xqt.size(1) == t && out.size(0) == n && out.size(1) == k)) return false;
  if (n == 0 || k == 0 || t == 0 || n % 16 || k % 16 || t % 16) return false;
  if (!(sg.scalar_type() == at::kFloat && sx.scalar_type() == at::kFloat && sg.numel() == 1 && sx.numel() == 1)) return false;
  // 16 for out too, not the 4 an fp32 matrix needs: with C/D 4 bytes past a 16-byte boundary (alignment
  // preferences set to 4) cuBLASLt 13 crashed the process on the H200 (a segmentation fault inside the call,
  // tests/test_fp8_wgrad.py offset 1, 2026-12-01).
  return alignment(gqt.data_ptr()) >= 16 && alignment(xqt.data_ptr()) >= 16 && alignment(out.data_ptr()) >= 16;
}

}  // namespace

// Returns false (nothing written) for a problem it does not take (see `takes`); raises when cuBLASLt
// refuses one it should take (the caller remembers that problem and falls back).
bool fp8_wgrad(torch::Tensor out, torch::Tensor gqt, torch::Tensor sg, torch::Tensor xqt, torch::Tensor sx,
               bool accumulate, bool fast_accum) {
  if (!takes(out, gqt, sg, xqt, sx)) return false;
  const int64_t n = gqt.size(0), k = xqt.size(0), t = gqt.size(1);
  const cudaDataType_t ta = fp8_type(xqt), tb = fp8_type(gqt);
  c10::cuda::CUDAGuard guard(out.device());

  MatmulDesc desc;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  const void* sa = sx.data_ptr();
  const void* sb = sg.data_ptr();
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa);
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb);
  desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum ? 1 : 0));
  Layout la(ta, t, k, t), lb(tb, t, n, t), lc(CUDA_R_32F, k, n, k);

  const uint32_t al_a = alignment(xqt.data_ptr()), al_b = alignment(gqt.data_ptr()), al_c = alignment(out.data_ptr());
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const Key key{n, k, t, (int)ta, (int)tb, al_a, al_b, al_c, accumulate, fast_accum, out.get_device()};
  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(algo_mutex);
    auto it = algo_cache.find(key);
    if (it != algo_cache.end()) {
      algo = it->second;
    } else {
      Preference pref;
      pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kWorkspace));
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c);
      cublasLtMatmulHeuristicResult_t heur;
      int found = 0;
      check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.d, la.l, lb.l, lc.l, lc.l, pref.p, 1, &heur, &found),
               "cublasLtMatmulAlgoGetHeuristic");
      TORCH_CHECK(found > 0, "megacoat fp8_wgrad: cuBLASLt has no FP8 GEMM with an fp32 accumulating output for [",
                  n, ", ", k, "] x ", t, " on this GPU");
      algo = heur.algo;
      algo_cache.emplace(key, algo);
    }
  }
  auto workspace = at::empty({static_cast<int64_t>(kWorkspace)}, out.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  check_lt(cublasLtMatmul(handle, desc.d, &alpha, xqt.data_ptr(), la.l, gqt.data_ptr(), lb.l, &beta, out.data_ptr(), lc.l,
                          out.data_ptr(), lc.l, &algo, workspace.data_ptr(), kWorkspace,
                          c10::cuda::getCurrentCUDAStream()),
           "cublasLtMatmul");
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_wgrad", &fp8_wgrad, "out[N, K] (+)= (gqt[N, T] * sg) @ (xqt[K, T] * sx)^T in fp32 (cuBLASLt FP8, beta = 1); False: "
        "a problem it does not take, nothing written",
        py::arg("out"), py::arg("gqt"), py::arg("sg"), py::arg("xqt"), py::arg("sx"), py::arg("accumulate"),
        py::arg("fast_accum") = false);
}
