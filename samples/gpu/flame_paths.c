/*
 * Known native call paths to the CUDA driver, for the flame graph tests
 * (samples/gpu/flame_server.py calls them through ctypes). Built -O2 without frame
 * pointers, as CUDA's and PyTorch's libraries are: only .eh_frame unwinds them.
 *
 *   tt_attention(qkv, score) -> tt_launch(qkv), tt_launch(score) -> cuLaunchKernel
 *   tt_mlp(up, down)         -> tt_launch(up), tt_launch(down)   -> cuLaunchKernel
 *   tt_copy_out(dst, n)      -> cuMemcpyDtoH_v2
 *   tt_native_thread(f, n)   -> a new thread: n x tt_launch(f) -> cuLaunchKernel
 */
#include <pthread.h>

typedef void *CUfunction;
typedef void *CUstream;
int cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   unsigned, CUstream, void **, void **);
int cuMemcpyDtoH_v2(void *dst, unsigned long long src, unsigned long n);

/* a frame of its own with locals: the unwinder has to use its CFA rules */
__attribute__((noinline)) int tt_launch(CUfunction f, unsigned grid)
{
    volatile unsigned blocks[8];
    for (int i = 0; i < 8; i++)
        blocks[i] = grid + i;
    int rc = cuLaunchKernel(f, blocks[0], 1, 1, 128, 1, 1, 0, 0, 0, 0);
    return rc + (int)blocks[7] - (int)(grid + 7);
}

__attribute__((noinline)) int tt_attention(CUfunction qkv, CUfunction score)
{
    volatile char scratch[200];
    scratch[0] = 1;
    int rc = tt_launch(qkv, 4);
    rc |= tt_launch(score, 8 + scratch[0]);
    return rc;
}

__attribute__((noinline)) int tt_mlp(CUfunction up, CUfunction down)
{
    int rc = tt_launch(up, 16);
    rc |= tt_launch(down, 16);
    return rc;
}

/* not a tail call (a jump would leave no frame of its own, as real code often does) */
__attribute__((noinline)) int tt_copy_out(void *dst, unsigned long n)
{
    volatile int rc = cuMemcpyDtoH_v2(dst, 0x7f0000001000ULL, n);
    return rc;
}

/* A thread of the process that no Python code runs on (a C++ worker, NCCL's proxy):
 * it launches n times and is joined. It has no Python thread state, so it must get
 * no Python frames (tests/test_live_flame.py). */
struct tt_worker { CUfunction f; int n; };

static void *tt_worker_run(void *p)
{
    struct tt_worker *w = p;
    for (int i = 0; i < w->n; i++)
        tt_launch(w->f, 2);
    return 0;
}

int tt_native_thread(CUfunction f, int n)
{
    pthread_t t;
    struct tt_worker w = {f, n};
    if (pthread_create(&t, 0, tt_worker_run, &w) != 0)
        return -1;
    return pthread_join(t, 0);
}
