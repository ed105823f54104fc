// FP8 GEMM through cuBLASLt with per-tensor scales, writing or adding into its output:
//   out[M, N] (+)= (a[M, K] * sa) @ (b[N, K] * sb)^T,   out fp32 or bf16
// Used for the FP8 linear's weight gradient, added into the fp32 main gradient in the GEMM's epilogue
// (beta = 1): torch._scaled_mm can write an fp32 output (`out=`) but cannot add to one, so without this
// every micro-batch after a step's first paid an fp32 temporary plus an add pass over the weight gradient
// (16 bytes per weight element; on the H200 1.8 ms per micro-batch at 1.36B, 11.7 ms at 7B:
// `benchmarks/fp8_bench.py --parts wgrad`). Megatron + TransformerEngine do the same through TE's
// GEMM with accumulate=True. With `candidates` > 1 it also times that many of cuBLASLt's algorithms for a
// problem on its first call and keeps the fastest (the heuristic's first choice is not always the fastest).
// Host code only (cuBLASLt runs the kernels): compiled by the host compiler, not nvcc.
//
// Layout: every tensor is row-major. cuBLASLt is column-major and its FP8 GEMMs take only the "TN"
// form, so the product is written as out^T (column-major [N, M], ld N) = A^T B with A = b seen as
// column-major [K, N] (ld K, transposed) and B = a seen as column-major [K, M] (ld K): both operands
// are read K-major (K contiguous), which is what the FP8 tensor-core kernels want.
// Only the headers it needs: torch/extension.h alone takes ~20 s to compile.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's Tensor casters
#include <torch/library.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "megacoat fp8_gemm: ", what); }

void check_lt(cublasStatus_t s, const char* call) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "megacoat fp8_gemm: ", call, " failed with cuBLAS status ", (int)s);
}

cudaDataType_t fp8_type(const at::Tensor& t) {
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

// The chosen algorithm per problem (a few layer shapes per model): asking the heuristic costs more host time
// than the launch itself, and tuning costs a few milliseconds once.
using Key = std::tuple<int64_t, int64_t, int64_t, int, int, int, uint32_t, uint32_t, uint32_t, bool, bool, int>;
struct Choice {
  cublasLtMatmulAlgo_t algo;
  int64_t candidates;  // how many algorithms it was chosen from
};
std::map<Key, Choice> algo_cache;
std::mutex algo_mutex;

// What tuning measured, per problem: (m, n, k, a dtype, b dtype, out dtype, accumulate, index of the chosen
// candidate, milliseconds per candidate in the heuristic's order, < 0 where a candidate failed to run).
using Report = std::tuple<int64_t, int64_t, int64_t, std::string, std::string, std::string, bool, int64_t,
                          std::vector<double>>;
std::vector<Report> tuning_reports;

bool is_fp8(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

// Whether the cuBLASLt FP8 GEMM takes the problem: the caller runs its fallback where it does not. Checked
// here rather than in Python: this runs on every micro-batch of every linear, where Python's checks cost
// more host time than the launch (`benchmarks/profile_step.py --host-profile` on the coat recipe, H200).
bool takes(const at::Tensor& out, const at::Tensor& a, const at::Tensor& sa, const at::Tensor& b,
           const at::Tensor& sb) {
  if (!(out.is_cuda() && a.is_cuda() && b.is_cuda() && sa.is_cuda() && sb.is_cuda())) return false;
  const auto dev = out.get_device();
  if (a.get_device() != dev || b.get_device() != dev || sa.get_device() != dev || sb.get_device() != dev) return false;
  if (!((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.dim() == 2 &&
        out.is_contiguous())) return false;
  if (!(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous())) return false;
  if (!(is_fp8(a) && is_fp8(b))) return false;
  if (a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2) return false;  // no such kernel
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  if (!(b.size(1) == k && out.size(0) == m && out.size(1) == n)) return false;
  if (m == 0 || n == 0 || k == 0 || m % 16 || n % 16 || k % 16) return false;
  if (!(sa.scalar_type() == at::kFloat && sb.scalar_type() == at::kFloat && sa.numel() == 1 && sb.numel() == 1)) return false;
  // 16 for out too, not the 4 an fp32 matrix needs: with C/D 4 bytes past a 16-byte boundary (alignment
  // preferences set to 4) cuBLASLt 13 crashed the process on the H200 (a segmentation fault inside the call,
  // tests/test_fp8_gemm.py with offset 1).
  return alignment(a.data_ptr()) >= 16 && alignment(b.data_ptr()) >= 16 && alignment(out.data_ptr()) >= 16;
}

// Milliseconds per call of `algo` on a scratch output (tuning must not add into the caller's), or -1 if it fails.
double time_algo(cublasLtHandle_t handle, const MatmulDesc& desc, const Layout& la, const Layout& lb, const Layout& lc,
                 const void* a_ptr, const void* b_ptr, const at::Tensor& scratch, float beta,
                 const cublasLtMatmulAlgo_t& algo, void* workspace, size_t workspace_size, cudaStream_t stream) {
  const float alpha = 1.0f;
  auto run = [&]() {
    return cublasLtMatmul(handle, desc.d, &alpha, a_ptr, la.l, b_ptr, lb.l, &beta, scratch.data_ptr(), lc.l,
                          scratch.data_ptr(), lc.l, &algo, workspace, workspace_size, stream);
  };
  if (run() != CUBLAS_STATUS_SUCCESS) return -1.0;
  constexpr int kReps = 3;
  cudaEvent_t start, stop;
  C10_CUDA_CHECK(cudaEventCreate(&start));
  C10_CUDA_CHECK(cudaEventCreate(&stop));
  C10_CUDA_CHECK(cudaEventRecord(start, stream));
  bool ok = true;
  for (int i = 0; i < kReps && ok; ++i) ok = run() == CUBLAS_STATUS_SUCCESS;
  C10_CUDA_CHECK(cudaEventRecord(stop, stream));
  C10_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ok ? ms / kReps : -1.0;
}

std::string dtype_name(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

}  // namespace

// Returns false (nothing written) for a problem it does not take (see `takes`); raises when cuBLASLt
// refuses one it should take (the caller remembers that problem and falls back). `candidates` > 1: on a
// problem's first call (outside CUDA graph capture) time up to that many of the heuristic's algorithms and
// keep the fastest; 1: the heuristic's first choice, as torch._scaled_mm.
bool fp8_gemm(at::Tensor out, at::Tensor a, at::Tensor sa, at::Tensor b, at::Tensor sb,
              bool accumulate, bool fast_accum, int64_t candidates) {
  if (!takes(out, a, sa, b, sb)) return false;
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  const cudaDataType_t ta = fp8_type(b), tb = fp8_type(a);
  const cudaDataType_t tc = out.scalar_type() == at::kFloat ? CUDA_R_32F : CUDA_R_16BF;
  c10::cuda::CUDAGuard guard(out.device());

  MatmulDesc desc;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  const void* scale_a = sb.data_ptr();
  const void* scale_b = sa.data_ptr();
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_a);
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_b);
  desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum ? 1 : 0));
  Layout la(ta, k, n, k), lb(tb, k, m, k), lc(tc, n, m, n);

  const uint32_t al_a = alignment(b.data_ptr()), al_b = alignment(a.data_ptr()), al_c = alignment(out.data_ptr());
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  candidates = std::max<int64_t>(1, std::min<int64_t>(candidates, 32));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;  // no timing (it synchronizes) inside a graph
  const Key key{m, n, k, (int)ta, (int)tb, (int)tc, al_a, al_b, al_c, accumulate, fast_accum, out.get_device()};
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  cublasLtMatmulAlgo_t algo;
  // torch's own cuBLASLt workspace for this stream (what _scaled_mm uses): one per stream for the run, and torch
  // handles it under CUDA graph capture (a workspace of our own made while Inductor's CUDA graphs warm up stayed
  // in their memory pool untracked, and they refused to run).
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  {
    std::lock_guard<std::mutex> lock(algo_mutex);
    auto it = algo_cache.find(key);
    // A choice made from fewer algorithms than asked for now is made again (not while capturing a graph).
    if (it != algo_cache.end() && (it->second.candidates >= candidates || capturing)) {
      algo = it->second.algo;
    } else {
      if (capturing) candidates = 1;
      Preference pref;
      pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_size));
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c);
      std::vector<cublasLtMatmulHeuristicResult_t> heur(candidates);
      int found = 0;
      check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.d, la.l, lb.l, lc.l, lc.l, pref.p, (int)candidates,
                                              heur.data(), &found),
               "cublasLtMatmulAlgoGetHeuristic");
      TORCH_CHECK(found > 0, "megacoat fp8_gemm: cuBLASLt has no FP8 GEMM for [", m, ", ", k, "] x [", n, ", ", k,
                  "]^T with a ", c10::toString(out.scalar_type()), " output on this GPU");
      int64_t best = 0;
      // Tuning writes a scratch copy (beta = 1 adds into it), never the caller's output. Without memory for it
      // (a weight gradient's first backward runs near the peak) the heuristic's first choice is kept.
      at::Tensor scratch;
      if (found > 1) {
        try {
          scratch = accumulate ? out.clone() : at::empty_like(out);
        } catch (const c10::OutOfMemoryError&) {
          scratch = at::Tensor();
        }
      }
      if (scratch.defined()) {
        // Rounds over all candidates, each candidate's fastest round kept: a GEMM slowed once by a clock or
        // power swing does not decide. Another algorithm replaces the heuristic's first only when clearly
        // faster (kMargin), so that noise does not change the choice (and the rounding) from run to run.
        constexpr int kRounds = 3;
        constexpr double kMargin = 0.98;
        std::vector<double> ms(found, -1.0);
        std::vector<bool> usable(found);
        for (int i = 0; i < found; ++i) usable[i] = heur[i].state == CUBLAS_STATUS_SUCCESS;
        for (int r = 0; r < kRounds; ++r) {
          for (int i = 0; i < found; ++i) {
            if (!usable[i]) continue;
            const double t = time_algo(handle, desc, la, lb, lc, b.data_ptr(), a.data_ptr(), scratch, beta,
                                       heur[i].algo, workspace, workspace_size, stream);
            if (t < 0) { usable[i] = false; ms[i] = -1.0; continue; }
            ms[i] = ms[i] < 0 ? t : std::min(ms[i], t);
          }
        }
        for (int i = 0; i < found; ++i) {
          if (ms[i] >= 0 && (ms[best] < 0 || ms[i] < ms[best] * (best == 0 ? kMargin : 1.0))) best = i;
        }
        TORCH_CHECK(ms[best] >= 0, "megacoat fp8_gemm: none of cuBLASLt's ", found, " algorithms ran for [", m, ", ",
                    k, "] x [", n, ", ", k, "]^T");
        tuning_reports.emplace_back(m, n, k, dtype_name(a), dtype_name(b), dtype_name(out), accumulate, best, ms);
      }
      algo = heur[best].algo;
      algo_cache[key] = Choice{algo, candidates};
    }
  }
  check_lt(cublasLtMatmul(handle, desc.d, &alpha, b.data_ptr(), la.l, a.data_ptr(), lb.l, &beta, out.data_ptr(), lc.l,
                          out.data_ptr(), lc.l, &algo, workspace, workspace_size, stream),
           "cublasLtMatmul");
  return true;
}

namespace {

// Problems cuBLASLt refused (no algorithm): they run the fallback for the rest of the run, after one warning.
std::set<std::tuple<int64_t, int64_t, int64_t, int, int, int, bool>> refused;

// fp8_gemm, or false where it declines the problem or cuBLASLt refuses it (remembered, one warning).
bool gemm_or_decline(at::Tensor out, const at::Tensor& a, const at::Tensor& sa, const at::Tensor& b,
                     const at::Tensor& sb, bool accumulate, bool fast_accum, int64_t candidates) {
  const auto key = std::make_tuple(a.size(0), b.size(0), a.dim() == 2 ? a.size(1) : 0, (int)a.scalar_type(),
                                   (int)b.scalar_type(), (int)out.scalar_type(), accumulate);
  {
    std::lock_guard<std::mutex> lock(algo_mutex);
    if (!refused.empty() && refused.count(key)) return false;
  }
  try {
    return fp8_gemm(out, a, sa, b, sb, accumulate, fast_accum, candidates);
  } catch (const c10::OutOfMemoryError&) {
    throw;  // a condition of this call, not of the problem
  } catch (const c10::Error& e) {
    // Only cuBLASLt's own refusals (this file's checks, which all come before the launch: nothing was written);
    // a CUDA error (e.g. a sticky one from an earlier kernel) is not a property of the problem.
    if (std::string(e.what_without_backtrace()).find("megacoat fp8_gemm: ") == std::string::npos) throw;
    std::lock_guard<std::mutex> lock(algo_mutex);
    refused.insert(key);
    TORCH_WARN("megacoat fp8_gemm: cuBLASLt refused a problem (", e.what_without_backtrace(),
               "); it runs torch._scaled_mm for the rest of this run (slower)");
    return false;
  }
}

}  // namespace

// The FP8 linear's forward and dgrad GEMM as a dispatcher op (megacoat_lt::fp8_mm): (a * sa) @ (b * sb)^T in
// out_dtype. One C++ call from compiled graphs, with the algorithm chosen (and optionally tuned) once per problem.
// Its host time per call equals torch._scaled_mm's (18 against 19 us on the H200, fp8_bench.py --parts host); a
// Python custom op would add its wrapper.
at::Tensor fp8_mm_op(const at::Tensor& a, const at::Tensor& sa, const at::Tensor& b,
                        const at::Tensor& sb, at::ScalarType out_dtype, bool fast_accum, int64_t candidates) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "megacoat_lt::fp8_mm: 2-D operands expected");
  auto out = at::empty({a.size(0), b.size(0)}, a.options().dtype(out_dtype));
  if (gemm_or_decline(out, a, sa, b, sb, false, fast_accum, candidates)) return out;
  return at::_scaled_mm(a, b.t(), sa, sb, std::nullopt, std::nullopt, out_dtype, fast_accum);
}

// The FP8 linear's weight gradient into its fp32 main gradient (megacoat_lt::fp8_wgrad): written on the step's
// first micro-batch (the one-element CPU flag `overwrite`, then cleared), added in the GEMM's epilogue after.
// Returns the placeholder weight gradient (uninitialised, never read). Writes main_grad and the flag without
// declaring them (kernels/wgrad.py explains why). A main_grad view the GEMM cannot take (4 bytes off a 16-byte
// boundary) gets a temporary product and one copy or add.
at::Tensor fp8_wgrad_op(const at::Tensor& main_grad, const at::Tensor& gqt, const at::Tensor& sg,
                           const at::Tensor& xqt, const at::Tensor& sx, const at::Tensor& overwrite,
                           int64_t candidates, at::ScalarType weight_dtype) {
  TORCH_CHECK(overwrite.device().is_cpu() && overwrite.scalar_type() == at::kBool && overwrite.numel() == 1,
              "megacoat_lt::fp8_wgrad: the overwrite flag must be a one-element CPU bool tensor");
  TORCH_CHECK(main_grad.storage().nbytes() >=
                  static_cast<size_t>((main_grad.storage_offset() + main_grad.numel()) * main_grad.element_size()),
              "a gradient arrived for a parameter whose gradient buffer is released (its bucket was not re-allocated "
              "before this backward: the model did not call its pre_backward_hook before this module's backward; a "
              "module used outside GPTModel.forward?)");
  TORCH_CHECK(gqt.dim() == 2 && xqt.dim() == 2 && main_grad.numel() == gqt.size(0) * xqt.size(0) &&
                  main_grad.scalar_type() == at::kFloat && main_grad.is_contiguous(),
              "megacoat_lt::fp8_wgrad: main_grad must be a contiguous fp32 tensor of ", gqt.size(0), " x ",
              xqt.size(0), " elements");
  bool* flag = overwrite.data_ptr<bool>();
  const bool first = *flag;
  auto mg = main_grad.view({gqt.size(0), xqt.size(0)});
  if (!gemm_or_decline(mg, gqt, sg, xqt, sx, !first, false, candidates)) {
    auto dw = at::empty(mg.sizes(), mg.options());
    if (!gemm_or_decline(dw, gqt, sg, xqt, sx, false, false, candidates))
      dw = at::_scaled_mm(gqt, xqt.t(), sg, sx, std::nullopt, std::nullopt, at::kFloat, false);
    if (first) mg.copy_(dw); else mg.add_(dw);
  }
  *flag = false;
  return at::empty(main_grad.sizes(), main_grad.options().dtype(weight_dtype));
}

TORCH_LIBRARY(megacoat_lt, m) {
  m.def("fp8_mm(Tensor a, Tensor sa, Tensor b, Tensor sb, ScalarType out_dtype, bool fast_accum, int candidates) "
        "-> Tensor");
  m.def("fp8_wgrad(Tensor main_grad, Tensor gqt, Tensor sg, Tensor xqt, Tensor sx, Tensor overwrite, int candidates, "
        "ScalarType weight_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(megacoat_lt, CUDA, m) {
  m.impl("fp8_mm", &fp8_mm_op);
  m.impl("fp8_wgrad", &fp8_wgrad_op);
}

std::vector<Report> tuning_report() {
  std::lock_guard<std::mutex> lock(algo_mutex);
  return tuning_reports;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_gemm", &fp8_gemm, "out[M, N] (+)= (a[M, K] * sa) @ (b[N, K] * sb)^T, out fp32 or bf16 (cuBLASLt FP8; "
        "accumulate: beta = 1); False: a problem it does not take, nothing written. candidates > 1: time that many "
        "algorithms on a problem's first call and keep the fastest",
        py::arg("out"), py::arg("a"), py::arg("sa"), py::arg("b"), py::arg("sb"), py::arg("accumulate"),
        py::arg("fast_accum") = false, py::arg("candidates") = 1);
  m.def("tuning_report", &tuning_report, "(m, n, k, a dtype, b dtype, out dtype, accumulate, chosen index, "
        "milliseconds per candidate) for each problem tuned so far");
}
