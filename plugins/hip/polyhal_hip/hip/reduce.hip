// Reductions over any set of axes: one workgroup per output element. Macros (set by
// polyhal_hip/reduction.py):
//
//   T       element type of input and output      A  accumulator type
//   INIT    the identity of the reduction (of A)  COMBINE(p, q)  two partial results -> one
//   FINISH(acc, count)   the output from the accumulated value (mean divides)
//
// Dims: the kept dimensions (shape ks, input strides kst) enumerate outputs; the reduced
// dimensions (shape rs, input strides rst) enumerate the elements of one output. Threads of the
// workgroup stride over those elements, then combine through shared memory (blockDim.x is a
// power of two, at most 1024).

#define MAX_DIMS 8
struct RDims {
    long long ks[MAX_DIMS];
    long long kst[MAX_DIMS];
    long long rs[MAX_DIMS];
    long long rst[MAX_DIMS];
};

template <typename V> __device__ __forceinline__ V polyhal_rmax(V a, V b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
template <typename V> __device__ __forceinline__ V polyhal_rmin(V a, V b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }

extern "C" __global__ void polyhal_reduce(const T* __restrict__ x, T* __restrict__ y, long long outputs,
                                          int kdim, long long count, int rdim, RDims d) {
    __shared__ A part[1024];
    for (long long o = blockIdx.x; o < outputs; o += gridDim.x) {
        long long r = o, base = 0;
        for (int k = kdim - 1; k >= 0; --k) { const long long c = r % d.ks[k]; r /= d.ks[k]; base += c * d.kst[k]; }
        A acc = INIT;
        for (long long j = threadIdx.x; j < count; j += blockDim.x) {
            long long q = j, off = base;
            for (int k = rdim - 1; k >= 0; --k) { const long long c = q % d.rs[k]; q /= d.rs[k]; off += c * d.rst[k]; }
            const A v = (A)x[off];
            acc = COMBINE(acc, v);
        }
        part[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned s = blockDim.x >> 1; s > 0; s >>= 1) {
            if (threadIdx.x < s) part[threadIdx.x] = COMBINE(part[threadIdx.x], part[threadIdx.x + s]);
            __syncthreads();
        }
        if (threadIdx.x == 0) y[o] = (T)(FINISH(part[0], count));
        __syncthreads();
    }
}
