/*
 * A stand-in libibverbs.so.1 for machines without an RDMA device, compiled against the
 * real <infiniband/verbs.h> (Debian's libibverbs-dev): the real soname, the real
 * exported symbols, signatures and symbol versions of the calls tokentrace probes,
 * including the IBVERBS_1.0 compat duplicates that only old binaries bind to.
 *
 * As in rdma-core, the data path is not here: ibv_open_device loads a provider library
 * (libibverbs/libttsim-rdmav34.so next to this file, its functions static and the
 * file stripped, like Debian's providers) that registers itself through
 * verbs_register_driver_34 and fills ctx->ops.post_send/post_recv/poll_cq, which the
 * inline ibv_post_send/ibv_post_recv/ibv_poll_cq of verbs.h call. Object creation goes
 * through the provider's private table (in rdma-core: struct verbs_context_ops).
 *
 * Registrations, deregistrations and QP modifications are counted here and written as
 * JSON at exit to TT_STANDIN_VERBS_COUNTS: ground truth for the tests.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <libgen.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "ttsim.h"

#undef ibv_reg_mr
#undef ibv_reg_mr_iova

#define EXPORT __attribute__((visibility("default"), noinline))

static const struct ttsim_driver *driver;
static _Atomic unsigned long long n_open, n_reg, reg_bytes, n_dereg, dereg_bytes, n_modify,
    n_ack;

EXPORT void verbs_register_driver_34(const struct ttsim_driver *d) { driver = d; }

__attribute__((destructor)) static void write_counts(void)
{
    const char *path = getenv("TT_STANDIN_VERBS_COUNTS");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!f)
        return;
    fprintf(f, "{\"open_device\": %llu, \"reg_mr\": %llu, \"reg_bytes\": %llu, "
               "\"dereg_mr\": %llu, \"dereg_bytes\": %llu, \"modify_qp\": %llu, "
               "\"ack_cq_events\": %llu}\n",
            n_open, n_reg, reg_bytes, n_dereg, dereg_bytes, n_modify, n_ack);
    fclose(f);
}

static struct ibv_device device = {
    .node_type = IBV_NODE_CA,
    .transport_type = IBV_TRANSPORT_IB,
    .name = "ttsim0",
    .dev_name = "uverbs0",
};

EXPORT struct ibv_device **ibv_get_device_list(int *num)
{
    struct ibv_device **l = calloc(2, sizeof(*l));
    l[0] = &device;
    if (num)
        *num = 1;
    return l;
}

EXPORT void ibv_free_device_list(struct ibv_device **list) { free(list); }

EXPORT const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }

/* the provider lives in libibverbs/ beside this library, as in rdma-core's layout */
static int load_provider(void)
{
    if (driver)
        return 0;
    Dl_info info;
    if (!dladdr((void *)load_provider, &info) || !info.dli_fname)
        return -1;
    char dir[4096], path[4200];
    snprintf(dir, sizeof(dir), "%s", info.dli_fname);
    snprintf(path, sizeof(path), "%s/libibverbs/libttsim-rdmav34.so", dirname(dir));
    if (!dlopen(path, RTLD_NOW)) {
        fprintf(stderr, "libibverbs stand-in: %s\n", dlerror());
        return -1;
    }
    return driver ? 0 : -1;
}

struct ibv_context *ibv_open_device_1_1(struct ibv_device *d)
{
    if (load_provider() != 0)
        return NULL;
    n_open++;
    return driver->alloc_context(d);
}
EXPORT struct ibv_context *ibv_open_device_1_0(struct ibv_device *d)
{
    return ibv_open_device_1_1(d);
}
__asm__(".symver ibv_open_device_1_1, ibv_open_device@@IBVERBS_1.1");
__asm__(".symver ibv_open_device_1_0, ibv_open_device@IBVERBS_1.0");

EXPORT int ibv_close_device(struct ibv_context *ctx)
{
    driver->free_context(ctx);
    return 0;
}

EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx) { return driver->alloc_pd(ctx); }
EXPORT int ibv_dealloc_pd(struct ibv_pd *pd) { return driver->dealloc_pd(pd); }

EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                                    struct ibv_comp_channel *channel, int comp_vector)
{
    return driver->create_cq(ctx, cqe, cq_context);
}
EXPORT int ibv_destroy_cq(struct ibv_cq *cq) { return driver->destroy_cq(cq); }

EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
    return driver->create_qp(pd, attr);
}
EXPORT int ibv_destroy_qp(struct ibv_qp *qp) { return driver->destroy_qp(qp); }

int ibv_modify_qp_1_1(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
    n_modify++;
    return driver->modify_qp(qp, attr, attr_mask);
}
EXPORT int ibv_modify_qp_1_0(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
    return ibv_modify_qp_1_1(qp, attr, attr_mask);
}
__asm__(".symver ibv_modify_qp_1_1, ibv_modify_qp@@IBVERBS_1.1");
__asm__(".symver ibv_modify_qp_1_0, ibv_modify_qp@IBVERBS_1.0");

/* All registrations end here, as in rdma-core >= v23 (ibv_reg_mr and ibv_reg_mr_iova
 * call it through the PLT). */
EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length,
                                       uint64_t iova, unsigned int access)
{
    struct ibv_mr *mr = driver->reg_mr(pd, addr, length, iova, access);
    if (mr) {
        n_reg++;
        reg_bytes += length;
    }
    return mr;
}

struct ibv_mr *ibv_reg_mr_1_1(struct ibv_pd *pd, void *addr, size_t length, int access)
{
    return ibv_reg_mr_iova2(pd, addr, length, (uintptr_t)addr, access);
}
EXPORT struct ibv_mr *ibv_reg_mr_1_0(struct ibv_pd *pd, void *addr, size_t length, int access)
{
    return ibv_reg_mr_1_1(pd, addr, length, access);
}
__asm__(".symver ibv_reg_mr_1_1, ibv_reg_mr@@IBVERBS_1.1");
__asm__(".symver ibv_reg_mr_1_0, ibv_reg_mr@IBVERBS_1.0");

EXPORT struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t length,
                                      uint64_t iova, int access)
{
    return ibv_reg_mr_iova2(pd, addr, length, iova, access);
}

int ibv_dereg_mr_1_1(struct ibv_mr *mr)
{
    size_t length = mr->length;
    int ret = driver->dereg_mr(mr);
    if (ret == 0) {
        n_dereg++;
        dereg_bytes += length;
    }
    return ret;
}
EXPORT int ibv_dereg_mr_1_0(struct ibv_mr *mr) { return ibv_dereg_mr_1_1(mr); }
__asm__(".symver ibv_dereg_mr_1_1, ibv_dereg_mr@@IBVERBS_1.1");
__asm__(".symver ibv_dereg_mr_1_0, ibv_dereg_mr@IBVERBS_1.0");

EXPORT void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents) { n_ack++; }
