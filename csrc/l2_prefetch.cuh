// L2 prefetch hint shared by the fused kernels (sm_90 bulk prefetch: no registers, nothing waits).
#pragma once
#include <stdint.h>

// Ask L2 for [p, p + bytes). Rounded out to 16 bytes as the instruction needs; the rounding stays
// inside the same 16-byte block, so inside the allocation's pages.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
  if (bytes <= 0) return;
  const uint64_t a = reinterpret_cast<uintptr_t>(p) & ~uint64_t(15);
  const uint64_t e = (reinterpret_cast<uintptr_t>(p) + (uint64_t)bytes + 15) & ~uint64_t(15);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((uint32_t)(e - a)) : "memory");
}
