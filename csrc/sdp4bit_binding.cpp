// torch binding of SDP4Bit's CUDA kernels (sdp4bit_encode.cu, sdp4bit_requantize.cu): decides whether a call
// is covered, checks the tensors, fills the kernels' parameters and launches on the current stream. A separate
// host-only file, so that torch's headers are compiled once by the host compiler instead of in every device
// pass of nvcc; and only the headers it needs (torch/extension.h alone takes ~20 s to compile).

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's Tensor casters

#include "sdp4bit.h"

using namespace megacoat_sdp4bit;

namespace {

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

// Returns false (nothing launched) for what this kernel does not cover: bits != 8, groups other
// than 32..512 (powers of two), sources not 16-byte aligned at every block; the caller then runs the
// Triton kernel. max_blocks > 0 caps the grid (the warps then loop), 0: one warp per 512 elements.
bool encode_partitioned(at::Tensor src, at::Tensor out, int64_t shard_size, int64_t slice_off,
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
  C10_CUDA_CHECK(launch_encode(P, bf16, (int)group, hadamard, (int)blocks, stream));
  return true;
}

// Returns false (nothing launched) for what this kernel does not cover: bits_out != 4, bits_in other
// than 4 / 8, output groups other than 32..512 or input groups other than powers of two >= 32, more
// than 65535 destinations, messages not 4-byte aligned; the caller then runs the Triton kernel.
// max_blocks > 0 caps the grid's x dimension (the warps then loop).
bool reduce_requantize(at::Tensor msgs, at::Tensor out, int64_t n, int64_t bits_in, int64_t group_in,
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
  C10_CUDA_CHECK(launch_requantize(P, (int)bits_in, (int)group_out, grid, stream));
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_partitioned", &encode_partitioned,
        "SDP4Bit TLq-HS encode: [Hadamard +] int8 stochastic group quantization in partition order "
        "(fp32/bf16 bucket); False when the configuration is not covered");
  m.def("reduce_requantize", &reduce_requantize,
        "SDP4Bit TLq-HS between hops: sum of dequantized int8/int4 messages -> int4 requantization; False when "
        "the configuration is not covered");
}
