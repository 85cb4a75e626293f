/*
 * Kernels of a shared library, as nvcc would emit them, for the host-stub naming test
 * (samples/gpu/stub_workload.c). Built stripped (-s): the exported host stubs are in
 * .dynsym only, and the static one has no symbol at all, so it cannot be named.
 *
 * Each host stub is the host function carrying its kernel's mangled name; launching
 * the kernel calls it, and it passes its own address to the runtime, as nvcc's
 * __device_stub__ code does. A constructor registers them, as nvcc's static
 * initialiser does.
 */
#include <stddef.h>

#include "standin/cudart.h"

static const dim3 grid = {1, 1, 1}, block = {128, 1, 1};

void _Z13tt_so_kernel0Pf(float *p)
{
    void *args[] = {&p};
    cudaLaunchKernel((const void *)_Z13tt_so_kernel0Pf, grid, block, args, 0, NULL);
}

void _Z13tt_so_kernel1Pf(float *p)
{
    void *args[] = {&p};
    cudaLaunchCooperativeKernel_ptsz((const void *)_Z13tt_so_kernel1Pf, grid, block, args,
                                     0, NULL);
}

void _Z13tt_so_kernel2Pf(float *p)
{
    void *args[] = {&p};
    cudaLaunchConfig_t cfg = {grid, block, 0, NULL, NULL, 0};
    cudaLaunchKernelExC_ptsz(&cfg, (const void *)_Z13tt_so_kernel2Pf, args);
}

/* local: stripped away with .symtab, so its address has no name anywhere */
static void hidden_kernel(float *p)
{
    void *args[] = {&p};
    cudaLaunchKernel((const void *)hidden_kernel, grid, block, args, 0, NULL);
}

void tt_so_launch_hidden(float *p) { hidden_kernel(p); }

__attribute__((constructor)) static void register_kernels(void)
{
    static char fatbin[16];
    void **h = __cudaRegisterFatBinary(fatbin);
    __cudaRegisterFunction(h, (const char *)_Z13tt_so_kernel0Pf, "_Z13tt_so_kernel0Pf",
                           "_Z13tt_so_kernel0Pf", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(h, (const char *)_Z13tt_so_kernel1Pf, "_Z13tt_so_kernel1Pf",
                           "_Z13tt_so_kernel1Pf", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(h, (const char *)_Z13tt_so_kernel2Pf, "_Z13tt_so_kernel2Pf",
                           "_Z13tt_so_kernel2Pf", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(h, (const char *)hidden_kernel, "_Z13hidden_kernelPf",
                           "_Z13hidden_kernelPf", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFatBinaryEnd(h);
}
