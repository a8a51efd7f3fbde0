// One kernel source for OpenCL C 1.2 and CUDA C++ (NVRTC; hiprtc alike): the few words that
// differ are macros here. The host code prepends this file and a block of #defines (the op's
// shapes, element types T / ACC and flags) to a source of this folder; no other includes.
//
// A kernel takes every buffer as two parameters, BUF(type, name): the base address and the
// element offset of the tensor in it (OpenCL's convention, so a tensor may start anywhere in a
// pooled buffer; CUDA passes offset 0). BIND(type, name) declares the tensor's pointer; a
// pointer into a tensor is declared GLOBAL T*.
#ifdef __OPENCL_VERSION__
#if USE_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif
typedef long i64;
#define KERNEL __kernel void
#define FN inline
#define GLOBAL __global
#define CONSTANT __constant
#define GLOBAL_ID ((i64)get_global_id(0))
#define BUF(T_, n) __global T_* n##_base, const ulong n##_off
#define BIND(T_, n) __global T_* n = n##_base + n##_off
#else
typedef long long i64;
#define KERNEL extern "C" __global__ void
#define FN __device__ inline
#define GLOBAL
#define CONSTANT __constant__
#define GLOBAL_ID ((i64)blockIdx.x * blockDim.x + threadIdx.x)
#define BUF(T_, n) T_* n##_base, const unsigned long long n##_off
#define BIND(T_, n) T_* n = n##_base + n##_off
#endif

FN i64 clamp_index(i64 i, i64 lo, i64 hi) { return i < lo ? lo : (i > hi ? hi : i); }
