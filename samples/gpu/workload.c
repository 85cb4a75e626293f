/*
 * A decode-loop-shaped GPU workload, linked against libcuda.so.1 and libnccl.so.2 like
 * any CUDA program: the stand-ins here, the real driver on a GPU machine is NOT the
 * target (it passes no valid modules); PyTorch workloads cover that.
 *
 *   workload [--steps N] [--kernels K] [--threads T] [--graph-every G] [--nccl]
 *            [--d2d N] [--input-sync] [--wait] [--hold] [--linger]
 *
 * Each thread resolves K kernels (even ones with cuLibraryGetKernel, odd ones with
 * cuModuleGetFunction, kernel 1 also through cuKernelGetFunction), then per step: an
 * H2D copy (with --input-sync a stream sync after it, as PyTorch makes after a copy
 * from pageable memory), K launches (kernel 1's asked for through cuKernelGetFunction
 * again before each, as cuBLASLt does; every 4th with cuLaunchKernelEx), a graph launch
 * every G steps, N device-to-device copies (--d2d), a memset, an NCCL all-reduce in a
 * group when --nccl, a D2H copy, and a stream sync (every 4th step polls cuStreamQuery
 * instead). --wait prints "ready" and waits for a line on stdin before resolving
 * anything, so a tracer can attach first. --hold: after its steps each thread launches
 * its K kernels once more and syncs the stream, a sync with no D2H copy before it (as
 * a PyTorch script's closing torch.cuda.synchronize()), then waits: "held" is printed
 * when all wait, and a line on stdin lets them go.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUfunction, *CUkernel, *CUstream, *CUgraphExec, *CUmodule, *CUlibrary;
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shmem; CUstream s; void *attrs; unsigned n; } CUlaunchConfig;

CUresult cuInit(unsigned);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLibraryGetKernel(CUkernel *, CUlibrary, const char *);
CUresult cuKernelGetFunction(CUfunction *, CUkernel);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, unsigned, CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned, size_t, CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
int ncclGetUniqueId(ncclUniqueId *);
int ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int);
int ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, CUstream);
int ncclGroupStart(void);
int ncclGroupEnd(void);

static int steps = 100, kernels = 8, threads = 1, graph_every = 0, use_nccl = 0, d2d = 0;
static int input_sync = 0, hold = 0;
static ncclComm_t comm;
static int held, released;
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;

/* --hold: a tail of launches and a sync that ends no step, then wait for main */
static void hold_tail(CUfunction *f, CUstream s)
{
    for (int k = 0; k < kernels; k++)
        cuLaunchKernel(f[k], 1, 1, 1, 128, 1, 1, 0, s, NULL, NULL);
    cuStreamSynchronize(s);
    pthread_mutex_lock(&hold_mu);
    held++;
    pthread_cond_broadcast(&hold_cv);
    while (!released)
        pthread_cond_wait(&hold_cv, &hold_mu);
    pthread_mutex_unlock(&hold_mu);
}

static void *run(void *arg)
{
    long t = (long)arg;
    CUfunction *f = calloc(kernels, sizeof(*f));
    void *kern1 = NULL;
    char name[64];
    for (int k = 0; k < kernels; k++) {
        snprintf(name, sizeof(name), "_Z11tt_kernel_%02dPfS_i", k);
        if (k % 2 == 0)
            cuLibraryGetKernel((CUkernel *)&f[k], NULL, name);
        else
            cuModuleGetFunction(&f[k], NULL, name);
        if (k == 1) {
            kern1 = f[k];
            cuKernelGetFunction(&f[k], f[k]); /* launch through the alias */
        }
    }
    CUdeviceptr buf, out;
    cuMemAlloc_v2(&buf, 1 << 20);
    cuMemAlloc_v2(&out, 4096 + t);
    static char host[1 << 16];
    CUstream s = (CUstream)(t + 1);
    CUlaunchConfig cfg = {1, 1, 1, 128, 1, 1, 0, s, NULL, 0};
    for (int step = 0; step < steps; step++) {
        cuMemcpyHtoDAsync_v2(buf, host, 1000 + step, s);
        if (input_sync)
            cuStreamSynchronize(s);
        for (int k = 0; k < kernels; k++) {
            if (k == 1)
                cuKernelGetFunction(&f[k], (CUkernel)kern1);
            if (k % 4 == 3)
                cuLaunchKernelEx(&cfg, f[k], NULL, NULL);
            else
                cuLaunchKernel(f[k], 1, 1, 1, 128, 1, 1, 0, s, NULL, NULL);
        }
        if (graph_every && step % graph_every == 0)
            cuGraphLaunch((CUgraphExec)0x1, s);
        for (int c = 0; c < d2d; c++) /* device-to-device copies, as an engine's step */
            cuMemcpyDtoDAsync_v2(out, buf, 256, s);
        cuMemsetD32Async(out, 0, 256, s);
        if (use_nccl) {
            ncclGroupStart();
            ncclAllReduce((void *)buf, (void *)buf, 4096, 6 /* fp16 */, 0, comm, s);
            ncclGroupEnd();
        }
        cuMemcpyDtoHAsync_v2(host, out, 64, s);
        if (step % 4 == 3) {
            CUresult r;
            while ((r = cuStreamQuery(s)) == 600 /* CUDA_ERROR_NOT_READY */)
                ;
            if (r != 0) { /* not the stand-in (a real driver, uninitialised): stop */
                fprintf(stderr, "workload: cuStreamQuery returned %d\n", r);
                exit(2);
            }
        } else
            cuStreamSynchronize(s);
    }
    if (hold)
        hold_tail(f, s);
    cuMemFree_v2(buf);
    cuMemFree_v2(out);
    free(f);
    return NULL;
}

int main(int argc, char **argv)
{
    int wait = 0, linger = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kernels") && i + 1 < argc) kernels = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--graph-every") && i + 1 < argc) graph_every = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--d2d") && i + 1 < argc) d2d = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--nccl")) use_nccl = 1;
        else if (!strcmp(argv[i], "--input-sync")) input_sync = 1;
        else if (!strcmp(argv[i], "--wait")) wait = 1;
        else if (!strcmp(argv[i], "--hold")) hold = 1;
        else if (!strcmp(argv[i], "--linger")) linger = 1; /* exit at the next line */
        else { fprintf(stderr, "workload: unknown argument %s\n", argv[i]); return 2; }
    }
    if (wait) {
        char line[16];
        printf("ready\n");
        fflush(stdout);
        if (!fgets(line, sizeof(line), stdin))
            return 1;
    }
    cuInit(0);
    if (use_nccl) {
        ncclUniqueId id;
        ncclGetUniqueId(&id);
        ncclCommInitRank(&comm, 1, id, 0);
    }
    pthread_t th[64];
    if (threads > 64) threads = 64;
    for (long t = 0; t < threads; t++)
        pthread_create(&th[t], NULL, run, (void *)t);
    if (hold) {
        char line[16];
        pthread_mutex_lock(&hold_mu);
        while (held < threads)
            pthread_cond_wait(&hold_cv, &hold_mu);
        pthread_mutex_unlock(&hold_mu);
        printf("held\n");
        fflush(stdout);
        if (!fgets(line, sizeof(line), stdin))
            return 1;
        pthread_mutex_lock(&hold_mu);
        released = 1;
        pthread_cond_broadcast(&hold_cv);
        pthread_mutex_unlock(&hold_mu);
    }
    for (int t = 0; t < threads; t++)
        pthread_join(th[t], NULL);
    printf("done\n");
    fflush(stdout);
    if (linger) {
        char line[16];
        if (!fgets(line, sizeof(line), stdin))
            return 0;
    }
    return 0;
}
