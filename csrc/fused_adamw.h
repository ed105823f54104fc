// The fused AdamW step's interface between its kernels (fused_adamw.cu, CUDA only) and its torch binding
// (fused_adamw_binding.cpp): kept free of torch's headers, so that the device compilation does not parse them.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace megacoat_adamw {

constexpr int kGroup = 128;
constexpr int kSegmentBits = 10;                  // fp8_adam._SEGMENT_BITS
constexpr int kLog2Segments = 1 << kSegmentBits;  // fp8_adam.LOG2_SEGMENTS

// Moment formats (fp8_adam.FORMAT_CODE). kFp8Expand: COAT's dynamic range expansion in the exp2/log2 form
// (fp8_adam.quantize_groups with fast=True); code 3, COAT's powf form, exists only in the torch reference.
enum Format : int { kFp32 = 0, kBf16 = 1, kFp8 = 2, kFp8Expand = 4 };

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
  const float2* log2_tab;         // [kLog2Segments] (T0, T1): fp8_adam.log2_table (kFp8Expand only)
};

// Launches the step for moments in format `fmt` on `stream`. Returns the first CUDA error, cudaSuccess once
// launched (or when there is nothing to do).
cudaError_t launch_adamw_step(const Args& A, int fmt, bool grad_is_bf16, cudaStream_t stream);

}  // namespace megacoat_adamw
