// Batched matrix product C[b] = A[b] @ B[b] (numpy matmul: batch dimensions broadcast), tiled
// through shared memory, TILE x TILE outputs per workgroup of TILE x TILE threads. Macros (set by
// polyhal_hip/linalg.py): T the element type, ACC the accumulator type (float for float16).
// Batch dims: shape bs, element strides of A and B per batch dim (0 where broadcast); C is dense.

#define TILE 16
#define MAX_DIMS 8
struct BDims {
    long long bs[MAX_DIMS];
    long long sa[MAX_DIMS];
    long long sb[MAX_DIMS];
};

extern "C" __global__ void polyhal_matmul(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                                          long long m, long long n, long long k, long long batches, int bdim,
                                          BDims d) {
    __shared__ ACC ta[TILE][TILE + 1];
    __shared__ ACC tb[TILE][TILE + 1];
    const long long row = (long long)blockIdx.y * TILE + threadIdx.y;
    const long long col = (long long)blockIdx.x * TILE + threadIdx.x;
    for (long long bt = blockIdx.z; bt < batches; bt += gridDim.z) {
        long long r = bt, oa = 0, ob = 0;
        for (int q = bdim - 1; q >= 0; --q) { const long long e = r % d.bs[q]; r /= d.bs[q]; oa += e * d.sa[q]; ob += e * d.sb[q]; }
        const T* pa = a + oa;
        const T* pb = b + ob;
        ACC acc = (ACC)0;
        for (long long t = 0; t < k; t += TILE) {
            const long long ka = t + threadIdx.x, kb = t + threadIdx.y;
            ta[threadIdx.y][threadIdx.x] = (row < m && ka < k) ? (ACC)pa[row * k + ka] : (ACC)0;
            tb[threadIdx.y][threadIdx.x] = (kb < k && col < n) ? (ACC)pb[kb * n + col] : (ACC)0;
            __syncthreads();
#pragma unroll
            for (int q = 0; q < TILE; ++q) acc += ta[threadIdx.y][q] * tb[q][threadIdx.x];
            __syncthreads();
        }
        if (row < m && col < n) c[bt * m * n + row * n + col] = (T)acc;
    }
}
