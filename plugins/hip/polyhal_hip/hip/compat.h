// CUDA idioms on HIP, so that polyhal-cuda's kernels (cu/*.cu, written for 32-thread warps)
// compile unchanged with hiprtc. Prepended to every source of polyhal-hip.
//
// Warps: the CUDA kernels treat a "warp" as 32 consecutive threads (lane = threadIdx.x & 31).
// On wave64 GPUs (CDNA: gfx908, gfx90a, gfx94x) a hardware wavefront holds two such groups;
// every shuffle below passes width 32, so it stays inside its 32-thread group and the kernels
// see exactly CUDA's warp semantics. On wave32 GPUs (RDNA: gfx10xx, gfx11xx) width 32 is the
// whole wavefront. A wavefront runs in lockstep, so __syncwarp needs no barrier, only a
// wavefront-scope fence to order shared-memory accesses; the mask arguments are ignored (every
// kernel here passes the full mask).
#define POLYHAL_HIP 1
#define __shfl_xor_sync(mask, v, o) __shfl_xor((v), (o), 32)
#define __shfl_up_sync(mask, v, d) __shfl_up((v), (d), 32)
#define __shfl_down_sync(mask, v, d) __shfl_down((v), (d), 32)
#define __shfl_sync(mask, v, s) __shfl((v), (s), 32)

__device__ __forceinline__ void polyhal_syncwarp() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
#define __syncwarp(...) polyhal_syncwarp()

// Back-off in spin loops (polyhal-cuda's onesweep look-back; polyhal-hip launches no radix path,
// but the whole source must compile): s_sleep takes a constant, ~64 cycles a unit.
#define __nanosleep(ns) __builtin_amdgcn_s_sleep(1)

// CUDA's __match_any_sync over a 32-thread group: the lanes whose value equals this lane's,
// from one ballot per bit (a ballot is a wavefront-wide compare; the group's half is shifted out
// on wave64). Every lane of the group must be active, as in every kernel here.
__device__ __forceinline__ unsigned int polyhal_match_any32(unsigned int v) {
    const unsigned int shift = __lane_id() & 32u;  // 32 for the upper group of a wave64, else 0
    unsigned int peers = (unsigned int)(__ballot(1) >> shift);
    for (int bit = 0; bit < 32; ++bit) {
        const unsigned int set = (unsigned int)(__ballot((int)((v >> bit) & 1u)) >> shift);
        peers &= ((v >> bit) & 1u) ? set : ~set;
    }
    return peers;
}
#define __match_any_sync(mask, v) polyhal_match_any32(v)
