// torch binding of the fused AdamW step (kernels: fused_adamw.cu): checks the tensors, gathers their
// addresses into the kernels' Args and launches on the current stream. A separate host-only file, so that
// torch's headers are compiled once by the host compiler instead of in every device pass of nvcc; and only
// the headers it needs (torch/extension.h alone takes ~20 s to compile).

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's Tensor casters

#include "fused_adamw.h"

namespace {

using namespace megacoat_adamw;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "megacoat fused_adamw: ", what); }

bool aligned16(const at::Tensor& t) { return t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

Moment moment_of(at::Tensor data, at::Tensor s, at::Tensor k, at::Tensor c) {
  check(data.is_cuda() && data.is_contiguous() && aligned16(data), "moment data must be contiguous CUDA tensors");
  auto ptr = [](at::Tensor t) { return t.numel() ? t.data_ptr<float>() : nullptr; };
  return Moment{data.data_ptr(), ptr(s), ptr(k), ptr(c)};
}

}  // namespace

void adamw_step(at::Tensor master, at::Tensor chunks, int64_t grad_is_bf16, at::Tensor decay,
                at::Tensor m_data, at::Tensor m_s, at::Tensor m_k, at::Tensor m_c, at::Tensor v_data,
                at::Tensor v_s, at::Tensor v_k, at::Tensor v_c, int64_t fmt, at::Tensor step,
                at::Tensor found_inf, at::Tensor coeff, double lr, double b1, double ob1, double b2, double ob2,
                double eps, double wd, double k16, double kmax, double tiny, at::Tensor log2_tab) {
  // chunks: int64 [4, nchunks + 1] on the device: group starts (nchunks + 1), gradient addresses,
  // weight addresses (0: none), element counts.
  check(master.is_cuda() && master.scalar_type() == at::kFloat && master.is_contiguous() && aligned16(master),
        "master must be a contiguous fp32 CUDA tensor");
  check(master.numel() % kGroup == 0, "the shard must hold whole groups of 128 elements");
  check(chunks.is_cuda() && chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(0) == 4 &&
        chunks.is_contiguous() && chunks.size(1) >= 2, "chunk table: int64 CUDA tensor [4, nchunks + 1]");
  check(decay.scalar_type() == at::kBool && decay.numel() == master.numel() / kGroup, "one decay flag per group");
  check(fmt == kFp32 || fmt == kBf16 || fmt == kFp8 || fmt == kFp8Expand,
        "unknown moment format (0 fp32, 1 bf16, 2 fp8, 4 fp8 with expansion in the exp2/log2 form)");
  check(fmt != kFp8Expand || (log2_tab.is_cuda() && log2_tab.scalar_type() == at::kFloat &&
                              log2_tab.is_contiguous() && log2_tab.numel() == 2 * kLog2Segments &&
                              aligned16(log2_tab) && log2_tab.get_device() == master.get_device()),
        "log2 table: the contiguous fp32 CUDA tensor [1024, 2] of fp8_adam.log2_table on the master's device");
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
  A.log2_tab = fmt == kFp8Expand ? reinterpret_cast<const float2*>(log2_tab.data_ptr<float>()) : nullptr;
  C10_CUDA_CHECK(launch_adamw_step(A, (int)fmt, grad_is_bf16 != 0, c10::cuda::getCurrentCUDAStream()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_step", &adamw_step, "Fused AdamW step over a flat shard (fp32/bf16/FP8 moments, bf16 weight out)",
        py::arg("master"), py::arg("chunks"), py::arg("grad_is_bf16"), py::arg("decay"), py::arg("m_data"),
        py::arg("m_s"), py::arg("m_k"), py::arg("m_c"), py::arg("v_data"), py::arg("v_s"), py::arg("v_k"),
        py::arg("v_c"), py::arg("fmt"), py::arg("step"), py::arg("found_inf"), py::arg("coeff"), py::arg("lr"),
        py::arg("b1"), py::arg("ob1"), py::arg("b2"), py::arg("ob2"), py::arg("eps"), py::arg("wd"), py::arg("k16"),
        py::arg("kmax"), py::arg("tiny"), py::arg("log2_tab"));
}
