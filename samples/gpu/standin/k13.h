/* The stand-in CUDA 13 runtime calls of samples/gpu/k13_kernels.c (standin/k13rt.c). */
#ifndef TT_STANDIN_K13_H
#define TT_STANDIN_K13_H
void __cudaRegisterFunction(void **h, const char *hostFun, char *deviceFun,
                            const char *deviceName, int limit, void *tid, void *bid,
                            void *bdim, void *gdim, int *wsize);
int __cudaGetKernel(void **out, const void *stub);
void tt_launch(void *handle);
#endif
