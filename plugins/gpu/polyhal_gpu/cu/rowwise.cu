// softmax over the last axis and layer normalisation over trailing dims: one block per row
// (grid-stride over rows), block reductions in shared memory. T is float or double.

template <typename T>
__global__ void softmax_rows(const T* __restrict__ x, T* __restrict__ y, i64 rows, int cols) {
    __shared__ T sh[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        T m = neg_inf<T>();
        for (int c = threadIdx.x; c < cols; c += blockDim.x) m = nanmax(m, xr[c]);
        m = block_reduce<T, true>(m, sh);
        T s = 0;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) s += exp(xr[c] - m);
        s = block_reduce<T, false>(s, sh);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = exp(xr[c] - m) / s;
    }
}

template <typename T>
__global__ void layer_norm_rows(const T* __restrict__ x, const T* __restrict__ scale, const T* __restrict__ bias,
                                T* __restrict__ y, i64 rows, int cols, T eps) {
    __shared__ T sh[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        T s = 0;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c];
        const T mean = block_reduce<T, false>(s, sh) / (T)cols;
        T q = 0;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) { T d = xr[c] - mean; q += d * d; }
        const T sd = sqrt(block_reduce<T, false>(q, sh) / (T)cols + eps);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = (xr[c] - mean) / sd * scale[c] + bias[c];
    }
}
