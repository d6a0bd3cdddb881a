// MEMKERN_HOST_DEVICE marks the per-element and per-row math that both the C++ CPU kernels
// (csrc/cpu, compiled by the host compiler) and the CUDA kernels (compiled by nvcc) include,
// so that the CPU test suite runs the very math a GPU runs. Headers using it include no CUDA
// or torch header: plain C++ on both sides.
#pragma once

#if defined(__CUDACC__)
#define MEMKERN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEMKERN_HOST_DEVICE inline
#endif
