// COLOMEM_HD: a function the host build and the CUDA kernels both compile (the element arithmetic a host
// version and its kernel share, so that their results are the same bits).
#pragma once

#ifndef COLOMEM_HD
#if defined(__CUDACC__)
#define COLOMEM_HD __host__ __device__ __forceinline__
#else
#define COLOMEM_HD inline
#endif
#endif
