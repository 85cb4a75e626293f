/*
 * A stand-in for what CUDA 13 code meets at start-up, for naming kernels resolved
 * before attach (tests/test_prenames.py): __cudaRegisterFunction records each host
 * stub's device name; __cudaGetKernel(&handle, stub) hands out a "driver object" per
 * kernel, laid out like a driver's: a pointer to the kernel's name at offset 24, and at
 * offset 8 the object made before it (whose name is another kernel's: a path a learner
 * must reject). tt_driver_kernel(name) is a driver-API lookup (cuLibraryGetKernel).
 * tt_launch(handle) launches through cuLaunchKernel when a (stand-in) libcuda is loaded
 * in the process, so that the tracer's real launch probes count it
 * (tests/test_live_prenames.py); with none, it only counts.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

struct object {
    unsigned long long magic;
    struct object *prev;
    void *library;
    const char *name;
    unsigned int attrs[8];
};
static struct object *last;
static struct { const void *stub; const char *name; } regs[64];
static int nregs;

void __cudaRegisterFunction(void **h, const char *hostFun, char *deviceFun,
                            const char *deviceName, int limit, void *tid, void *bid,
                            void *bdim, void *gdim, int *wsize)
{
    if (nregs < 64) {
        regs[nregs].stub = hostFun;
        regs[nregs].name = deviceFun;
        nregs++;
    }
}

void *tt_driver_kernel(const char *name)
{
    struct object *o = calloc(1, sizeof(*o));
    o->magic = 0x4b45524eULL;
    o->prev = last;
    o->name = strdup(name);
    last = o;
    return o;
}

int __cudaGetKernel(void **out, const void *stub)
{
    for (int i = 0; i < nregs; i++)
        if (regs[i].stub == stub) {
            *out = tt_driver_kernel(regs[i].name);
            return 0;
        }
    return 98;
}

/* the handle made for a name (the test's ground truth) */
void *tt_handle_named(const char *name)
{
    for (struct object *o = last; o; o = o->prev)
        if (!strcmp(o->name, name))
            return o;
    return NULL;
}

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shmem, void *stream,
                         void **params, void **extra);
volatile unsigned long long tt_launches;
void tt_launch(void *handle)
{
    static launch_fn launch;
    static int looked;
    if (!looked) { /* once: libcuda, if any, was loaded before the first launch */
        launch = (launch_fn)dlsym(RTLD_DEFAULT, "cuLaunchKernel");
        looked = 1;
    }
    tt_launches += handle != NULL;
    if (launch)
        launch(handle, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}
