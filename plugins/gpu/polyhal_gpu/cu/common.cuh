// Shared helpers of polyhal-cuda's kernels (included textually by the host code: NVRTC gets
// no include path, so sources are concatenated). No standard headers: NVRTC has none.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define FULL_MASK 0xffffffffu

template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ll); }

// max that propagates nan (as numpy's maximum and the op references do)
template <typename T> __device__ __forceinline__ T nanmax(T a, T b) { return (a > b || a != a) ? a : b; }

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
template <typename T> __device__ __forceinline__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) v = nanmax(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide sum (MAX=false) or max (MAX=true); blockDim.x is a multiple of 32, sh holds 32 T.
// Every thread gets the result.
template <typename T, bool MAX> __device__ T block_reduce(T v, T* sh) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();  // sh may still be read by the previous reduction
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        T w = lane < nw ? sh[lane] : (MAX ? neg_inf<T>() : (T)0);
        w = MAX ? warp_max(w) : warp_sum(w);
        if (lane == 0) sh[0] = w;
    }
    __syncthreads();
    return sh[0];
}
