/*
 * The stand-in libibverbs <-> stand-in provider interface. In rdma-core this is the
 * private struct verbs_device_ops / verbs_context_ops (driver.h, not installed); only
 * its role matters here: control verbs go through it, the data path goes through the
 * public ctx->ops that verbs.h's inline functions call.
 */
#ifndef TTSIM_H
#define TTSIM_H
#include <infiniband/verbs.h>

struct ttsim_driver {
    const char *name;
    struct ibv_context *(*alloc_context)(struct ibv_device *device);
    void (*free_context)(struct ibv_context *ctx);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *ctx);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_cq *(*create_cq)(struct ibv_context *ctx, int cqe, void *cq_context);
    int (*destroy_cq)(struct ibv_cq *cq);
    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
    int (*destroy_qp)(struct ibv_qp *qp);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                             unsigned int access);
    int (*dereg_mr)(struct ibv_mr *mr);
};

void verbs_register_driver_34(const struct ttsim_driver *driver);
#endif
