// Hopper bulk copies (the TMA's one-dimensional form) and the shared-memory mbarriers they complete on, in PTX
// (sm_90): a ring of shared-memory stages filled by one thread and read by the block (the wgmma kernel's token
// tiles), and the stores of its epilogue's tiled planes.
#pragma once

#include "common.cuh"

namespace sm90 {

using moe::u32;

// Bulk copies into shared memory that complete on an mbarrier (the async proxy, as wgmma reads B: no proxy fence
// between them). `bar` and `dst` are shared-memory addresses; dst, src and bytes multiples of 16.
__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the barriers this thread initialized visible to the async proxy (the bulk copies that complete on them).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// This thread's arrival, announcing `bytes` of bulk copies that will complete on the barrier's current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy_to_shared(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Bulk copy of `bytes` from shared memory (shared address `src`) to global memory, in this thread's bulk group; dst,
// src and bytes multiples of 16. The source must stay untouched until bulk_commit_wait_read says it has been read.
__device__ __forceinline__ void bulk_copy_to_global(void* dst, u32 src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}

// Closes this thread's bulk copies issued so far into a group, then waits until every group has read its source.
__device__ __forceinline__ void bulk_commit_wait_read() {
  asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Waits until the barrier's phase of parity `parity` has completed (its arrivals and bytes are in).
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

}  // namespace sm90
