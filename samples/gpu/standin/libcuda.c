/*
 * A stand-in libcuda.so.1 for machines without a GPU: the real soname, the real
 * exported symbols and signatures (cuda.h, CUDA 12/13 driver API) of the calls
 * tokentrace probes. Launches and copies do no work; synchronisation sleeps for the
 * GPU time the work queued since the last sync would have taken
 * (TT_STANDIN_KERNEL_NS per block of a cuLaunchKernel's grid X dimension, per launch
 * for the other launch calls; default 20000), so waits look like a GPU's. With
 * TT_STANDIN_ASYNC=1 the queued work runs while the host goes on, as on a GPU: it
 * starts at its launch (or when the work before it ends) and a sync waits only for
 * what is left.
 *
 * Every call is counted here too: at exit the counts are written as JSON to the file
 * named by TT_STANDIN_COUNTS, the ground truth the tests compare the tracer with.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "counts.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUfunc_st *CUfunction;
typedef struct CUkern_st *CUkernel;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUlaunchConfig_st CUlaunchConfig;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define EXPORT __attribute__((visibility("default"), noinline))

enum { C_LAUNCH, C_GRAPH, C_H2D, C_D2H, C_D2D, C_OTHER, C_H2D_BYTES, C_D2H_BYTES,
       C_D2D_BYTES, C_OTHER_BYTES, C_MEMSET, C_MEMSET_BYTES, C_SYNC, C_QUERY,
       C_QUERY_NOT_READY, C_ALLOC, C_ALLOC_BYTES, C_FREE, C_NAMES, C_ALIAS_LOOKUPS, C_N };
static const char *count_names[C_N] = {
    "launches", "graph_launches", "h2d_calls", "d2h_calls", "d2d_calls", "other_calls",
    "h2d_bytes", "d2h_bytes", "d2d_bytes", "other_bytes", "memset_calls", "memset_bytes",
    "sync_calls", "query_calls", "query_not_ready", "alloc_calls", "alloc_bytes",
    "free_calls", "names_resolved", "alias_lookups"};
static _Atomic unsigned long long counts[C_N];
static _Atomic unsigned long long next_ptr = 0x7f0000000000ULL;
static __thread unsigned long long pending_ns; /* GPU time queued by this thread */
static __thread unsigned long long busy_until; /* TT_STANDIN_ASYNC: its work ends then */

static void add(int which, unsigned long long n) { atomic_fetch_add(&counts[which], n); }

static unsigned long long kernel_ns(void)
{
    const char *v = getenv("TT_STANDIN_KERNEL_NS");
    return v ? strtoull(v, NULL, 10) : 20000ULL;
}

static int async_gpu(void)
{
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("TT_STANDIN_ASYNC");
        on = v && v[0] == '1';
    }
    return on;
}

static unsigned long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000ULL + t.tv_nsec;
}

/* GPU time queued by this thread's last call */
static void queue_gpu(unsigned long long ns)
{
    if (async_gpu()) {
        unsigned long long now = now_ns();
        busy_until = (busy_until > now ? busy_until : now) + ns;
    } else {
        pending_ns += ns;
    }
}

/* work still queued by this thread */
static int gpu_busy(void) { return async_gpu() ? busy_until > now_ns() : pending_ns != 0; }

static void wait_gpu(void)
{
    if (async_gpu()) {
        unsigned long long now = now_ns();
        if (busy_until > now) {
            unsigned long long left = busy_until - now;
            struct timespec ts = {left / 1000000000ULL, left % 1000000000ULL};
            nanosleep(&ts, NULL);
        }
        busy_until = 0;
        return;
    }
    if (pending_ns) {
        struct timespec ts = {pending_ns / 1000000000ULL, pending_ns % 1000000000ULL};
        nanosleep(&ts, NULL);
        pending_ns = 0;
    }
}

__attribute__((destructor)) static void write_counts(void)
{
    tt_write_counts("TT_STANDIN_COUNTS", count_names, counts, C_N);
}

EXPORT CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) { *d = ordinal; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxCreate_v2(CUcontext *c, unsigned int f, CUdevice d)
{
    (void)f; (void)d;
    *c = (CUcontext)malloc(8);
    return CUDA_SUCCESS;
}

/* ---- kernel handles: a heap object per name, as a driver's handles are pointers ---- */
struct CUfunc_st {
    char name[128];
    struct CUfunc_st *function; /* a kernel's function, once asked for (as the driver keeps) */
};

static void *new_handle(const char *name)
{
    struct CUfunc_st *h = calloc(1, sizeof(*h));
    if (name)
        strncpy(h->name, name, sizeof(h->name) - 1);
    add(C_NAMES, 1);
    return h;
}

EXPORT CUresult cuModuleGetFunction(CUfunction *out, CUmodule mod, const char *name)
{
    (void)mod;
    *out = new_handle(name);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLibraryGetKernel(CUkernel *out, CUlibrary lib, const char *name)
{
    (void)lib;
    *out = new_handle(name);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuKernelGetFunction(CUfunction *out, CUkernel kernel)
{
    struct CUfunc_st *k = (struct CUfunc_st *)kernel;
    add(C_ALIAS_LOOKUPS, 1);
    if (!k->function) /* the driver hands out one function per kernel and context */
        k->function = new_handle(k->name);
    *out = k->function;
    return CUDA_SUCCESS;
}

/* ---- launches ---------------------------------------------------------------------- */
static CUresult launched_grid(unsigned gx)
{
    add(C_LAUNCH, 1);
    queue_gpu(kernel_ns() * (gx ? gx : 1)); /* a kernel's time grows with its grid */
    return CUDA_SUCCESS;
}
static CUresult launched(void) { return launched_grid(1); }
#define LAUNCH_ARGS CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, \
    unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params
EXPORT CUresult cuLaunchKernel(LAUNCH_ARGS, void **extra) { return launched_grid(gx); }
EXPORT CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS, void **extra) { return launched_grid(gx); }
EXPORT CUresult cuLaunchCooperativeKernel(LAUNCH_ARGS) { return launched(); }
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(LAUNCH_ARGS) { return launched(); }
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                 void **extra) { return launched(); }
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f,
                                      void **params, void **extra) { return launched(); }
EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    add(C_GRAPH, 1);
    queue_gpu(10 * kernel_ns());
    return CUDA_SUCCESS;
}

/* ---- copies and memsets ------------------------------------------------------------ */
#define COPY(kind, bytes) (add(C_##kind, 1), add(C_##kind##_BYTES, (bytes)), CUDA_SUCCESS)
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { wait_gpu(); return COPY(H2D, n); }
EXPORT CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { wait_gpu(); return COPY(D2H, n); }
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return COPY(D2D, n); }
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, CUstream s) { return COPY(H2D, n); }
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, CUstream s) { return COPY(D2H, n); }
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return COPY(D2D, n); }
EXPORT CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return COPY(OTHER, n); }
EXPORT CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return COPY(OTHER, n); }
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc,
                                  size_t n, CUstream st) { return COPY(D2D, n); }
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { add(C_MEMSET, 1); add(C_MEMSET_BYTES, n); return CUDA_SUCCESS; }
EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) { add(C_MEMSET, 1); add(C_MEMSET_BYTES, 4 * n); return CUDA_SUCCESS; }

/* ---- synchronisation ----------------------------------------------------------------- */
EXPORT CUresult cuStreamSynchronize(CUstream s) { add(C_SYNC, 1); wait_gpu(); return CUDA_SUCCESS; }
EXPORT CUresult cuEventSynchronize(CUevent e) { add(C_SYNC, 1); wait_gpu(); return CUDA_SUCCESS; }
EXPORT CUresult cuCtxSynchronize(void) { add(C_SYNC, 1); wait_gpu(); return CUDA_SUCCESS; }
/* Polling: NOT_READY while work is queued; the GPU finishes it between two polls. */
EXPORT CUresult cuStreamQuery(CUstream s)
{
    add(C_QUERY, 1);
    if (gpu_busy()) {
        add(C_QUERY_NOT_READY, 1);
        wait_gpu();
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventQuery(CUevent e) { return cuStreamQuery(NULL); }

/* ---- device memory: fake device addresses, never dereferenced ----------------------- */
static CUresult alloc(CUdeviceptr *out, size_t n)
{
    *out = atomic_fetch_add(&next_ptr, (n + 4095) & ~4095ULL);
    add(C_ALLOC, 1);
    add(C_ALLOC_BYTES, n);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t n) { return alloc(out, n); }
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *out, size_t n, CUstream s) { return alloc(out, n); }
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { add(C_FREE, 1); return CUDA_SUCCESS; }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { add(C_FREE, 1); return CUDA_SUCCESS; }
