/*
 * A stand-in libcudart.so.12 for machines without a GPU: the real soname, and the real
 * exported symbols and signatures (cuda_runtime_api.h, crt/host_runtime.h) of the
 * calls nvcc-generated code makes to register and launch kernels.
 *
 * As with nvcc's output, a program registers each kernel's host stub (the host function
 * carrying the kernel's mangled name) with __cudaRegisterFunction at start-up, and
 * launches by passing that stub's address to cudaLaunchKernel*. Module loading is lazy
 * as in CUDA 12 (CUDA_MODULE_LOADING=EAGER: at __cudaRegisterFatBinaryEnd): a stub's
 * CUfunction is resolved with the stand-in driver's cuModuleGetFunction at its first
 * launch, and every launch then calls the driver's cuLaunchKernel* with it, on the
 * calling thread, as the real runtime does. An unregistered stub fails with
 * cudaErrorInvalidDeviceFunction before reaching the driver.
 *
 * Counts (TT_STANDIN_CUDART_COUNTS names the JSON file written at exit): runtime
 * launch calls, those that failed, and functions resolved.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "counts.h"
#include "cudart.h"

typedef int CUresult;
typedef struct CUfunc_st *CUfunction;
typedef struct CUmod_st *CUmodule;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    cudaStream_t hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

#define cudaSuccess 0
#define cudaErrorInvalidDeviceFunction 98
#define EXPORT __attribute__((visibility("default"), noinline))

/* the stand-in libcuda.so.1 */
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
#define DRIVER_LAUNCH_ARGS CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, \
    unsigned, unsigned, cudaStream_t, void **
CUresult cuLaunchKernel(DRIVER_LAUNCH_ARGS, void **);
CUresult cuLaunchKernel_ptsz(DRIVER_LAUNCH_ARGS, void **);
CUresult cuLaunchCooperativeKernel(DRIVER_LAUNCH_ARGS);
CUresult cuLaunchCooperativeKernel_ptsz(DRIVER_LAUNCH_ARGS);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuCtxSynchronize(void);

/* ---- registration ------------------------------------------------------------------ */
#define MAX_FUNCTIONS 1024
struct module { int id; };
struct registered {
    const void *host;       /* the host stub's address: what launches pass */
    struct module *module;
    char name[256];         /* the device function's mangled name */
    CUfunction f;           /* resolved at first launch (lazy loading) */
};
static struct registered functions[MAX_FUNCTIONS];
static int nfunctions;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

enum { R_LAUNCHES, R_FAILED, R_RESOLVED, R_N };
static const char *count_names[R_N] = {"runtime_launches", "runtime_failed", "resolved"};
static _Atomic unsigned long long counts[R_N];

__attribute__((destructor)) static void write_counts(void)
{
    tt_write_counts("TT_STANDIN_CUDART_COUNTS", count_names, counts, R_N);
}

static int eager(void)
{
    const char *v = getenv("CUDA_MODULE_LOADING");
    return v && !strcmp(v, "EAGER");
}

static void resolve(struct registered *r)
{
    if (!r->f) {
        cuModuleGetFunction(&r->f, (CUmodule)r->module, r->name);
        atomic_fetch_add(&counts[R_RESOLVED], 1);
    }
}

EXPORT void **__cudaRegisterFatBinary(void *fatCubin)
{
    static _Atomic int next_id;
    struct module *m = calloc(1, sizeof(*m));
    m->id = atomic_fetch_add(&next_id, 1);
    return (void **)m;
}

EXPORT void __cudaRegisterFatBinaryEnd(void **fatCubinHandle)
{
    if (!eager())
        return;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nfunctions; i++)
        if (functions[i].module == (struct module *)fatCubinHandle)
            resolve(&functions[i]);
    pthread_mutex_unlock(&lock);
}

EXPORT void __cudaUnregisterFatBinary(void **fatCubinHandle) { (void)fatCubinHandle; }

EXPORT void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun,
                                   char *deviceFun, const char *deviceName,
                                   int thread_limit, uint3 *tid, uint3 *bid, dim3 *bDim,
                                   dim3 *gDim, int *wSize)
{
    pthread_mutex_lock(&lock);
    if (nfunctions < MAX_FUNCTIONS) {
        struct registered *r = &functions[nfunctions++];
        r->host = hostFun;
        r->module = (struct module *)fatCubinHandle;
        strncpy(r->name, deviceName, sizeof(r->name) - 1);
    }
    pthread_mutex_unlock(&lock);
}

/* The stub's resolved CUfunction, or NULL if it was never registered. */
static CUfunction function_of(const void *func)
{
    CUfunction f = NULL;
    atomic_fetch_add(&counts[R_LAUNCHES], 1);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nfunctions; i++) {
        if (functions[i].host == func) {
            resolve(&functions[i]);
            f = functions[i].f;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    if (!f)
        atomic_fetch_add(&counts[R_FAILED], 1);
    return f;
}

/* ---- launches ------------------------------------------------------------------------ */
#define LAUNCH_PARAMS TT_CUDART_LAUNCH_PARAMS
#define DRIVER_ARGS f, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y, blockDim.z, \
    (unsigned)sharedMem, stream, args

EXPORT cudaError_t cudaLaunchKernel(LAUNCH_PARAMS)
{
    CUfunction f = function_of(func);
    return f ? cuLaunchKernel(DRIVER_ARGS, NULL) : cudaErrorInvalidDeviceFunction;
}
EXPORT cudaError_t cudaLaunchKernel_ptsz(LAUNCH_PARAMS)
{
    CUfunction f = function_of(func);
    return f ? cuLaunchKernel_ptsz(DRIVER_ARGS, NULL) : cudaErrorInvalidDeviceFunction;
}
EXPORT cudaError_t cudaLaunchCooperativeKernel(LAUNCH_PARAMS)
{
    CUfunction f = function_of(func);
    return f ? cuLaunchCooperativeKernel(DRIVER_ARGS) : cudaErrorInvalidDeviceFunction;
}
EXPORT cudaError_t cudaLaunchCooperativeKernel_ptsz(LAUNCH_PARAMS)
{
    CUfunction f = function_of(func);
    return f ? cuLaunchCooperativeKernel_ptsz(DRIVER_ARGS) : cudaErrorInvalidDeviceFunction;
}

static cudaError_t launch_ex(const cudaLaunchConfig_t *config, const void *func,
                             void **args, int ptsz)
{
    CUfunction f = function_of(func);
    if (!f)
        return cudaErrorInvalidDeviceFunction;
    CUlaunchConfig cfg = {config->gridDim.x, config->gridDim.y, config->gridDim.z,
                          config->blockDim.x, config->blockDim.y, config->blockDim.z,
                          (unsigned)config->dynamicSmemBytes, config->stream, NULL, 0};
    return ptsz ? cuLaunchKernelEx_ptsz(&cfg, f, args, NULL)
                : cuLaunchKernelEx(&cfg, f, args, NULL);
}
EXPORT cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func,
                                       void **args)
{
    return launch_ex(config, func, args, 0);
}
EXPORT cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t *config,
                                            const void *func, void **args)
{
    return launch_ex(config, func, args, 1);
}

EXPORT cudaError_t cudaDeviceSynchronize(void) { return cuCtxSynchronize(); }
