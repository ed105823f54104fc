// SDP4Bit's CUDA kernels' interface between the kernels (sdp4bit_encode.cu, sdp4bit_requantize.cu: CUDA
// only) and their torch binding (sdp4bit_binding.cpp): free of torch's headers, so that the device
// compilations do not parse them.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace megacoat_sdp4bit {

constexpr int kUnit = 512;  // elements per warp and iteration (32 lanes x 16)
constexpr int kWarps = 8;
constexpr int kRqUnit = 1024;  // reduce-requantize: elements per warp and iteration (32 lanes x 32)

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

// Launch the encode for fp32 (or bf16) sources, groups of `group` (32..512, a power of two), with the Hadamard
// transform or not; the requantize for int8 / int4 inputs, output groups of `group`. Return the launch's error.
cudaError_t launch_encode(const Params& P, bool bf16, int group, bool hadamard, int blocks, cudaStream_t stream);
cudaError_t launch_requantize(const RqParams& P, int bits_in, int group, dim3 grid, cudaStream_t stream);

}  // namespace megacoat_sdp4bit
