/*
 * The part of the CUDA runtime API (cuda_runtime_api.h, driver_types.h) that the
 * stand-in libcudart.so.12 exports and the host-stub test programs call: the real
 * types by value and the real signatures, so that the tracer's probes read arguments
 * exactly where they would in a real process.
 */
#ifndef TT_STANDIN_CUDART_H
#define TT_STANDIN_CUDART_H

#include <stddef.h>

typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
struct dim3 { unsigned int x, y, z; };
typedef struct dim3 dim3;
struct uint3 { unsigned int x, y, z; };
typedef struct uint3 uint3;
typedef struct cudaLaunchAttribute_st cudaLaunchAttribute;
typedef struct cudaLaunchConfig_st {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;

#define TT_CUDART_LAUNCH_PARAMS const void *func, dim3 gridDim, dim3 blockDim, void **args, \
    size_t sharedMem, cudaStream_t stream

cudaError_t cudaLaunchKernel(TT_CUDART_LAUNCH_PARAMS);
cudaError_t cudaLaunchKernel_ptsz(TT_CUDART_LAUNCH_PARAMS);
cudaError_t cudaLaunchCooperativeKernel(TT_CUDART_LAUNCH_PARAMS);
cudaError_t cudaLaunchCooperativeKernel_ptsz(TT_CUDART_LAUNCH_PARAMS);
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func,
                                void **args);
cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t *config, const void *func,
                                     void **args);
cudaError_t cudaDeviceSynchronize(void);

/* what nvcc's static initialiser calls for each translation unit and kernel */
void **__cudaRegisterFatBinary(void *fatCubin);
void __cudaRegisterFatBinaryEnd(void **fatCubinHandle);
void __cudaUnregisterFatBinary(void **fatCubinHandle);
void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                            const char *deviceName, int thread_limit, uint3 *tid,
                            uint3 *bid, dim3 *bDim, dim3 *gDim, int *wSize);

#endif
