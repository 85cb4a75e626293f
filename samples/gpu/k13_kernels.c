/*
 * Kernels of a stripped library as nvcc 13 emits them (tests/test_prenames.py): each
 * host stub keeps its kernel's handle in a static of its own, filled once by
 * __cudaGetKernel(&__handle, stub), and a constructor registers every stub with its
 * device name. Its .nv_fatbin (k13_fatbin.inc, made by samples/gpu/build.py) holds
 * cubins naming the kernels, except _Z9k13_ghostv: a registered name the cubins do not
 * confirm, which must never be given. Its .cask_resource holds a cubin like cuBLASLt's.
 */
#include "standin/k13.h"

#define STUB(k)                                                               \
    void k(void)                                                              \
    {                                                                         \
        static void *__handle;                                                \
        static int done;                                                      \
        if (!done) {                                                          \
            __cudaGetKernel(&__handle, (const void *)k);                      \
            done = 1;                                                         \
        }                                                                     \
        tt_launch(__handle);                                                  \
    }
STUB(k13_a)
STUB(k13_b)
STUB(k13_c)
STUB(k13_d)
STUB(k13_ghost)

__attribute__((section(".nv_fatbin"), used, aligned(8)))
static const unsigned char fatbin[] = {
#include "k13_fatbin.inc"
};

/* cuBLASLt names some kernels only in its read-only data: mangled names in a table,
 * and printf formats it builds names from at run time (nvjet_sm90_%s_%dx%d_...) */
__attribute__((used)) const char *const tt_kernel_table[] = {
    "_Z20cutlass_rodata_kernv", "ttjet_sm90_%s_%dx%d_%c", "%s"};

/* cuBLASLt keeps its own kernels (nvjet_*, cutlass_*) in a section of the same
 * containers, looked up by the driver API: one such cubin */
__attribute__((section(".cask_resource"), used, aligned(8)))
static const unsigned char cask[] = {
#include "k13_cask.inc"
};

__attribute__((constructor)) static void register_kernels(void)
{
    static char handle[16];
    void **h = (void **)handle;
    __cudaRegisterFunction(h, (const char *)k13_a, "_Z5k13_av", "_Z5k13_av", -1, 0, 0, 0, 0, 0);
    __cudaRegisterFunction(h, (const char *)k13_b, "_Z5k13_bv", "_Z5k13_bv", -1, 0, 0, 0, 0, 0);
    __cudaRegisterFunction(h, (const char *)k13_c, "_Z5k13_cv", "_Z5k13_cv", -1, 0, 0, 0, 0, 0);
    __cudaRegisterFunction(h, (const char *)k13_d, "_Z5k13_dv", "_Z5k13_dv", -1, 0, 0, 0, 0, 0);
    __cudaRegisterFunction(h, (const char *)k13_ghost, "_Z9k13_ghostv", "_Z9k13_ghostv", -1,
                           0, 0, 0, 0, 0);
}
