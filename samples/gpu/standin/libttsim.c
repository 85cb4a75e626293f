/*
 * A stand-in ibverbs provider, built as libibverbs/libttsim-rdmav34.so (the layout and
 * naming of rdma-core's providers, e.g. librxe-rdmav34.so): a loopback device whose
 * QPs deliver to the QP named by dest_qp_num in the same process. Its functions are
 * static and the file is stripped, like Debian's providers, so a tracer can only find
 * post_send/post_recv/poll_cq through ctx->ops.
 *
 * Semantics that matter to the tests: a SEND or RDMA_WRITE_WITH_IMM consumes one
 * posted receive of the peer (none posted: the sender gets IBV_WC_RNR_RETRY_EXC_ERR;
 * too small: the receiver gets IBV_WC_LOC_LEN_ERR); a send is completed when signaled
 * or failed; receive completions carry the bytes received in byte_len.
 *
 * Everything is counted and written as JSON at exit to TT_STANDIN_PROVIDER_COUNTS.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "ttsim.h"

#define RQ_DEPTH 4096
#define CQ_DEPTH 65536
#define MAX_QPS 1024
#define QPN_BASE 0x100

struct sim_cq {
    struct ibv_cq cq;
    pthread_mutex_t lock;
    struct ibv_wc wc[CQ_DEPTH];
    unsigned head, tail;
};

struct sim_qp {
    struct ibv_qp qp;
    struct sim_qp *peer;
    int sq_sig_all;
    pthread_mutex_t lock;
    uint64_t rq_id[RQ_DEPTH];
    uint64_t rq_cap[RQ_DEPTH];
    unsigned rq_head, rq_tail;
};

static struct sim_qp *qps[MAX_QPS];
static _Atomic unsigned next_qpn = QPN_BASE, next_key = 1;

/* ---- ground truth --------------------------------------------------------------- */

#define N_OP 256
static _Atomic unsigned long long post_send_calls, post_recv_calls, send_wrs[16],
    send_bytes[16], send_sges, recv_wrs, recv_bytes, recv_sges, polls, empty_polls,
    cqes[N_OP + 1], cqe_errors, cqe_bytes;
static _Atomic unsigned long long q_send_wrs[MAX_QPS], q_send_bytes[MAX_QPS],
    q_recv_wrs[MAX_QPS], q_recv_bytes[MAX_QPS], q_cqes[MAX_QPS], q_cqe_errors[MAX_QPS],
    q_cqe_bytes[MAX_QPS];

static const char *wr_name(int op)
{
    static const char *n[] = {"rdma_write", "rdma_write_with_imm", "send", "send_with_imm",
                              "rdma_read"};
    return op >= 0 && op < 5 ? n[op] : "other";
}

static const char *wc_name(int op)
{
    switch (op) {
    case IBV_WC_SEND: return "send";
    case IBV_WC_RDMA_WRITE: return "rdma_write";
    case IBV_WC_RDMA_READ: return "rdma_read";
    case IBV_WC_RECV: return "recv";
    case IBV_WC_RECV_RDMA_WITH_IMM: return "recv_rdma_with_imm";
    case N_OP: return "error";
    default: return "other";
    }
}

__attribute__((destructor)) static void write_counts(void)
{
    const char *path = getenv("TT_STANDIN_PROVIDER_COUNTS");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!f)
        return;
    fprintf(f, "{\"post_send_calls\": %llu, \"post_recv_calls\": %llu, \"send_sges\": %llu, "
               "\"recv_wrs\": %llu, \"recv_bytes\": %llu, \"recv_sges\": %llu, "
               "\"polls\": %llu, \"empty_polls\": %llu, \"completion_errors\": %llu, "
               "\"completion_bytes\": %llu",
            post_send_calls, post_recv_calls, send_sges, recv_wrs, recv_bytes, recv_sges, polls,
            empty_polls, cqe_errors, cqe_bytes);
    fprintf(f, ", \"send_wrs\": {");
    for (int i = 0, k = 0; i < 16; i++)
        if (send_wrs[i])
            fprintf(f, "%s\"%s\": %llu", k++ ? ", " : "", wr_name(i), send_wrs[i]);
    fprintf(f, "}, \"send_bytes\": {");
    for (int i = 0, k = 0; i < 16; i++)
        if (send_wrs[i])
            fprintf(f, "%s\"%s\": %llu", k++ ? ", " : "", wr_name(i), send_bytes[i]);
    fprintf(f, "}, \"completions\": {");
    for (int i = 0, k = 0; i <= N_OP; i++)
        if (cqes[i])
            fprintf(f, "%s\"%s\": %llu", k++ ? ", " : "", wc_name(i), cqes[i]);
    fprintf(f, "}, \"qps\": {");
    for (int i = 0, k = 0; i < MAX_QPS; i++)
        if (qps[i])
            fprintf(f, "%s\"%d\": {\"send_wrs\": %llu, \"send_bytes\": %llu, \"recv_wrs\": %llu, "
                       "\"recv_bytes\": %llu, \"completions\": %llu, \"completion_errors\": %llu, "
                       "\"completion_bytes\": %llu}",
                    k++ ? ", " : "", QPN_BASE + i, q_send_wrs[i], q_send_bytes[i], q_recv_wrs[i],
                    q_recv_bytes[i], q_cqes[i], q_cqe_errors[i], q_cqe_bytes[i]);
    fprintf(f, "}}\n");
    fclose(f);
}

/* ---- data path: reached only through ctx->ops ------------------------------------ */

static void push_wc(struct ibv_cq *ibcq, uint64_t wr_id, int status, int opcode,
                    uint32_t byte_len, uint32_t qp_num)
{
    struct sim_cq *cq = (struct sim_cq *)ibcq;
    pthread_mutex_lock(&cq->lock);
    if (cq->tail - cq->head < CQ_DEPTH) {
        struct ibv_wc *w = &cq->wc[cq->tail++ % CQ_DEPTH];
        memset(w, 0, sizeof(*w));
        w->wr_id = wr_id;
        w->status = status;
        w->opcode = opcode;
        w->byte_len = byte_len;
        w->qp_num = qp_num;
    }
    pthread_mutex_unlock(&cq->lock);
}

static int pop_recv(struct sim_qp *qp, uint64_t *id, uint64_t *cap)
{
    int ok = 0;
    pthread_mutex_lock(&qp->lock);
    if (qp->rq_head != qp->rq_tail) {
        *id = qp->rq_id[qp->rq_head % RQ_DEPTH];
        *cap = qp->rq_cap[qp->rq_head % RQ_DEPTH];
        qp->rq_head++;
        ok = 1;
    }
    pthread_mutex_unlock(&qp->lock);
    return ok;
}

static int sim_post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct sim_qp *qp = (struct sim_qp *)ibqp;
    unsigned q = ibqp->qp_num - QPN_BASE;
    post_send_calls++;
    for (; wr; wr = wr->next) {
        uint64_t bytes = 0;
        for (int i = 0; i < wr->num_sge; i++)
            bytes += wr->sg_list[i].length;
        int op = wr->opcode;
        send_wrs[op & 15]++;
        send_bytes[op & 15] += bytes;
        send_sges += wr->num_sge;
        q_send_wrs[q]++;
        q_send_bytes[q] += bytes;
        int status = IBV_WC_SUCCESS;
        if (op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE_WITH_IMM) {
            uint64_t id, cap;
            struct sim_qp *p = qp->peer;
            if (!p || !pop_recv(p, &id, &cap)) {
                status = IBV_WC_RNR_RETRY_EXC_ERR;
            } else {
                int rs = cap < bytes ? IBV_WC_LOC_LEN_ERR : IBV_WC_SUCCESS;
                push_wc(p->qp.recv_cq, id, rs,
                        op == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV,
                        rs ? 0 : (uint32_t)bytes, p->qp.qp_num);
            }
        }
        int wc_op = op == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ
                    : (op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM) ? IBV_WC_RDMA_WRITE
                    : IBV_WC_SEND;
        /* byte_len of a send completion is undefined in the spec: filled here so that a
         * tracer summing it would be caught */
        if (status || (wr->send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all)
            push_wc(ibqp->send_cq, wr->wr_id, status, wc_op, (uint32_t)bytes, ibqp->qp_num);
    }
    return 0;
}

static int sim_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct sim_qp *qp = (struct sim_qp *)ibqp;
    unsigned q = ibqp->qp_num - QPN_BASE;
    post_recv_calls++;
    for (; wr; wr = wr->next) {
        uint64_t cap = 0;
        for (int i = 0; i < wr->num_sge; i++)
            cap += wr->sg_list[i].length;
        recv_wrs++;
        recv_bytes += cap;
        recv_sges += wr->num_sge;
        q_recv_wrs[q]++;
        q_recv_bytes[q] += cap;
        pthread_mutex_lock(&qp->lock);
        if (qp->rq_tail - qp->rq_head >= RQ_DEPTH) {
            pthread_mutex_unlock(&qp->lock);
            *bad = wr;
            return ENOMEM;
        }
        qp->rq_id[qp->rq_tail % RQ_DEPTH] = wr->wr_id;
        qp->rq_cap[qp->rq_tail % RQ_DEPTH] = cap;
        qp->rq_tail++;
        pthread_mutex_unlock(&qp->lock);
    }
    return 0;
}

static int sim_poll_cq(struct ibv_cq *ibcq, int n, struct ibv_wc *wc)
{
    struct sim_cq *cq = (struct sim_cq *)ibcq;
    int k = 0;
    pthread_mutex_lock(&cq->lock);
    while (k < n && cq->head != cq->tail)
        wc[k++] = cq->wc[cq->head++ % CQ_DEPTH];
    pthread_mutex_unlock(&cq->lock);
    polls++;
    if (!k)
        empty_polls++;
    for (int i = 0; i < k; i++) {
        unsigned q = wc[i].qp_num - QPN_BASE;
        q_cqes[q]++;
        if (wc[i].status) {
            cqes[N_OP]++;
            cqe_errors++;
            q_cqe_errors[q]++;
            continue;
        }
        cqes[wc[i].opcode & (N_OP - 1)]++;
        if (wc[i].opcode & IBV_WC_RECV) {
            cqe_bytes += wc[i].byte_len;
            q_cqe_bytes[q] += wc[i].byte_len;
        }
    }
    return k;
}

/* ---- control path: through the private driver table ----------------------------- */

static struct ibv_context *sim_alloc_context(struct ibv_device *device)
{
    struct ibv_context *ctx = calloc(1, sizeof(*ctx));
    ctx->device = device;
    ctx->ops.post_send = sim_post_send;
    ctx->ops.post_recv = sim_post_recv;
    ctx->ops.poll_cq = sim_poll_cq;
    return ctx;
}

static void sim_free_context(struct ibv_context *ctx) { free(ctx); }

static struct ibv_pd *sim_alloc_pd(struct ibv_context *ctx)
{
    struct ibv_pd *pd = calloc(1, sizeof(*pd));
    pd->context = ctx;
    return pd;
}

static int sim_dealloc_pd(struct ibv_pd *pd)
{
    free(pd);
    return 0;
}

static struct ibv_cq *sim_create_cq(struct ibv_context *ctx, int cqe, void *cq_context)
{
    struct sim_cq *cq = calloc(1, sizeof(*cq));
    cq->cq.context = ctx;
    cq->cq.cq_context = cq_context;
    cq->cq.cqe = CQ_DEPTH;
    pthread_mutex_init(&cq->lock, NULL);
    return &cq->cq;
}

static int sim_destroy_cq(struct ibv_cq *cq)
{
    free(cq);
    return 0;
}

static struct ibv_qp *sim_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
    unsigned qpn = next_qpn++;
    if (qpn - QPN_BASE >= MAX_QPS)
        return NULL;
    struct sim_qp *qp = calloc(1, sizeof(*qp));
    qp->qp.context = pd->context;
    qp->qp.pd = pd;
    qp->qp.send_cq = attr->send_cq;
    qp->qp.recv_cq = attr->recv_cq;
    qp->qp.qp_num = qpn;
    qp->qp.state = IBV_QPS_RESET;
    qp->qp.qp_type = attr->qp_type;
    qp->sq_sig_all = attr->sq_sig_all;
    pthread_mutex_init(&qp->lock, NULL);
    qps[qpn - QPN_BASE] = qp;
    return &qp->qp;
}

static int sim_destroy_qp(struct ibv_qp *qp)
{
    /* kept in qps[] for the counts written at exit */
    return 0;
}

static int sim_modify_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr, int mask)
{
    struct sim_qp *qp = (struct sim_qp *)ibqp;
    if (mask & IBV_QP_STATE) {
        enum ibv_qp_state from = ibqp->state, to = attr->qp_state;
        if ((to == IBV_QPS_INIT && from != IBV_QPS_RESET) ||
            (to == IBV_QPS_RTR && from != IBV_QPS_INIT) ||
            (to == IBV_QPS_RTS && from != IBV_QPS_RTR))
            return EINVAL;
        ibqp->state = to;
    }
    if (mask & IBV_QP_DEST_QPN) {
        unsigned i = attr->dest_qp_num - QPN_BASE;
        qp->peer = i < MAX_QPS ? qps[i] : NULL;
    }
    return 0;
}

static struct ibv_mr *sim_reg_mr(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                                 unsigned int access)
{
    struct ibv_mr *mr = calloc(1, sizeof(*mr));
    mr->context = pd->context;
    mr->pd = pd;
    mr->addr = addr;
    mr->length = length;
    mr->lkey = mr->rkey = next_key++;
    return mr;
}

static int sim_dereg_mr(struct ibv_mr *mr)
{
    free(mr);
    return 0;
}

static const struct ttsim_driver driver = {
    .name = "ttsim",
    .alloc_context = sim_alloc_context,
    .free_context = sim_free_context,
    .alloc_pd = sim_alloc_pd,
    .dealloc_pd = sim_dealloc_pd,
    .create_cq = sim_create_cq,
    .destroy_cq = sim_destroy_cq,
    .create_qp = sim_create_qp,
    .destroy_qp = sim_destroy_qp,
    .modify_qp = sim_modify_qp,
    .reg_mr = sim_reg_mr,
    .dereg_mr = sim_dereg_mr,
};

__attribute__((constructor)) static void register_driver(void)
{
    verbs_register_driver_34(&driver);
}
