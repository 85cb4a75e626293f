/*
 * A CUDA runtime program whose kernels were all resolved before the tracer attached,
 * for the host-stub naming test (tests/test_live_stub_names.py). Linked against the
 * stand-ins libcudart.so.12 and libcuda.so.1 and against libttkernels.so
 * (stub_kernels.c, stripped).
 *
 * Its own host stubs are static (in .symtab only; this PIE is not stripped). At start
 * every kernel is registered, and all but _Z12tt_late_stubPf are launched once, which
 * resolves them (lazy loading) before anyone traces; so is a driver-API kernel,
 * "triton_poi_fused_0", launched with cuLaunchKernel as Triton does. Then it prints
 * {"ready": ..., "warmup_launches": N} and answers commands on stdin, one JSON line
 * each, with the launches it made by the name the tracer should give them
 * ("unknown:WHAT" for those it cannot name):
 *
 *   run N     N steps of: each stub of the program and the library once (through
 *             cudaLaunchKernel, _ptsz, cudaLaunchCooperativeKernel[_ptsz] and
 *             cudaLaunchKernelExC[_ptsz]), the late kernel (first resolved now, so named
 *             by the driver probe; its host stub's symbol is a different name, which
 *             must lose), a runtime launch of an unregistered address (fails before the
 *             driver) and the Triton-like driver launch, then a stream sync
 *   spin S    launch _Z12tt_exe_kern0Pf about every ms for S seconds
 *   after N   N steps of _Z12tt_exe_kern0Pf and _Z12tt_exe_kern4Pf (warmed up only, so
 *             its first launch since then is now)
 *   quit
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "standin/cudart.h"

typedef void *CUfunction;
int cuInit(unsigned);
int cuModuleGetFunction(CUfunction *, void *, const char *);
int cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   unsigned, cudaStream_t, void **, void **);
int cuStreamSynchronize(cudaStream_t);

/* libttkernels.so */
void _Z13tt_so_kernel0Pf(float *);
void _Z13tt_so_kernel1Pf(float *);
void _Z13tt_so_kernel2Pf(float *);
void tt_so_launch_hidden(float *);

static const dim3 grid = {1, 1, 1}, block = {128, 1, 1};

#define STUB(name, call)                                                                 \
    static void name(float *p)                                                           \
    {                                                                                    \
        void *args[] = {&p};                                                             \
        call;                                                                            \
    }
STUB(_Z12tt_exe_kern0Pf, cudaLaunchKernel((const void *)_Z12tt_exe_kern0Pf, grid, block, args, 0, NULL))
STUB(_Z12tt_exe_kern1Pf, cudaLaunchKernel_ptsz((const void *)_Z12tt_exe_kern1Pf, grid, block, args, 0, NULL))
STUB(_Z12tt_exe_kern2Pf, cudaLaunchCooperativeKernel((const void *)_Z12tt_exe_kern2Pf, grid, block, args, 0, NULL))
STUB(_Z12tt_exe_kern3Pf, cudaLaunchKernelExC(&(cudaLaunchConfig_t){grid, block, 0, NULL, NULL, 0}, (const void *)_Z12tt_exe_kern3Pf, args))
STUB(_Z12tt_exe_kern4Pf, cudaLaunchKernel((const void *)_Z12tt_exe_kern4Pf, grid, block, args, 0, NULL))
STUB(_Z12tt_late_stubPf, cudaLaunchKernel((const void *)_Z12tt_late_stubPf, grid, block, args, 0, NULL))

static void (*const exe_stubs[])(float *) = {_Z12tt_exe_kern0Pf, _Z12tt_exe_kern1Pf,
                                             _Z12tt_exe_kern2Pf, _Z12tt_exe_kern3Pf,
                                             _Z12tt_exe_kern4Pf};
static const char *const exe_names[] = {"_Z12tt_exe_kern0Pf", "_Z12tt_exe_kern1Pf",
                                        "_Z12tt_exe_kern2Pf", "_Z12tt_exe_kern3Pf",
                                        "_Z12tt_exe_kern4Pf"};

__attribute__((constructor)) static void register_kernels(void)
{
    static char fatbin[16];
    void **h = __cudaRegisterFatBinary(fatbin);
    for (int i = 0; i < 5; i++)
        __cudaRegisterFunction(h, (const char *)exe_stubs[i], (char *)exe_names[i],
                               exe_names[i], -1, NULL, NULL, NULL, NULL, NULL);
    /* the device name differs from the host symbol on purpose: see "run" above */
    __cudaRegisterFunction(h, (const char *)_Z12tt_late_stubPf, "_Z12tt_late_livePf",
                           "_Z12tt_late_livePf", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFatBinaryEnd(h);
}

static CUfunction triton;
static float buf[64];
static char unregistered[1]; /* an address the runtime never heard of */

enum { EXE0, EXE1, EXE2, EXE3, EXE4, SO0, SO1, SO2, HIDDEN, LATE, TRITON, NKERNELS };
static const char *const keys[NKERNELS] = {
    "_Z12tt_exe_kern0Pf", "_Z12tt_exe_kern1Pf", "_Z12tt_exe_kern2Pf", "_Z12tt_exe_kern3Pf",
    "unknown:exe_kern4", "_Z13tt_so_kernel0Pf", "_Z13tt_so_kernel1Pf", "_Z13tt_so_kernel2Pf",
    "unknown:hidden", "_Z12tt_late_livePf", "unknown:triton"};
static unsigned long long launched[NKERNELS];

static void launch(int k)
{
    switch (k) {
    case EXE0: case EXE1: case EXE2: case EXE3: case EXE4: exe_stubs[k](buf); break;
    case SO0: _Z13tt_so_kernel0Pf(buf); break;
    case SO1: _Z13tt_so_kernel1Pf(buf); break;
    case SO2: _Z13tt_so_kernel2Pf(buf); break;
    case HIDDEN: tt_so_launch_hidden(buf); break;
    case LATE: _Z12tt_late_stubPf(buf); break;
    case TRITON: {
        void *args[] = {buf};
        cuLaunchKernel(triton, 1, 1, 1, 128, 1, 1, 0, NULL, args, NULL);
        break;
    }
    }
    launched[k]++;
}

static void report(void)
{
    printf("{\"launches\": {");
    for (int k = 0; k < NKERNELS; k++)
        printf("%s\"%s\": %llu", k ? ", " : "", keys[k], launched[k]);
    printf("}}\n");
    fflush(stdout);
    memset(launched, 0, sizeof(launched));
}

int main(void)
{
    cuInit(0);
    cuModuleGetFunction(&triton, NULL, "triton_poi_fused_0");
    int warm = 0;
    for (int k = 0; k < NKERNELS; k++) {
        if (k != LATE) {
            launch(k);
            warm++;
        }
    }
    cuStreamSynchronize(NULL);
    memset(launched, 0, sizeof(launched));
    printf("{\"ready\": true, \"warmup_launches\": %d}\n", warm);
    fflush(stdout);

    char line[64];
    while (fgets(line, sizeof(line), stdin)) {
        double arg = 0;
        char cmd[16] = "";
        sscanf(line, "%15s %lf", cmd, &arg);
        if (!strcmp(cmd, "run")) {
            for (int step = 0; step < (int)arg; step++) {
                for (int k = EXE0; k <= EXE3; k++)
                    launch(k);
                for (int k = SO0; k <= LATE; k++)
                    launch(k);
                /* fails inside the runtime, before the driver: its stub is left pending
                 * for this thread, and the driver launch that follows is not its own */
                cudaLaunchKernel(unregistered, grid, block, NULL, 0, NULL);
                launch(TRITON);
                cuStreamSynchronize(NULL);
            }
        } else if (!strcmp(cmd, "spin")) {
            struct timespec t0, now, ms = {0, 1000000};
            clock_gettime(CLOCK_MONOTONIC, &t0);
            do {
                launch(EXE0);
                cuStreamSynchronize(NULL);
                nanosleep(&ms, NULL);
                clock_gettime(CLOCK_MONOTONIC, &now);
            } while ((now.tv_sec - t0.tv_sec) + (now.tv_nsec - t0.tv_nsec) / 1e9 < arg);
        } else if (!strcmp(cmd, "after")) {
            for (int step = 0; step < (int)arg; step++) {
                launch(EXE0);
                launch(EXE4);
                cuStreamSynchronize(NULL);
            }
        } else if (!strcmp(cmd, "quit")) {
            break;
        } else {
            printf("{\"error\": \"unknown command\"}\n");
            fflush(stdout);
            continue;
        }
        report();
    }
    return 0;
}
