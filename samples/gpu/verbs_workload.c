/*
 * An RDMA workload written as any ibverbs program is, against the real
 * <infiniband/verbs.h>: ibv_post_send, ibv_post_recv and ibv_poll_cq are the header's
 * inline functions (they call ctx->ops, i.e. the provider); ibv_reg_mr and
 * ibv_reg_mr_iova are the header's macros. Linked against libibverbs.so.1 by soname:
 * the stand-in here (samples/gpu/standin), the real library where it runs on a host
 * with a device.
 *
 *   verbs_workload [--steps N] [--threads T] [--batch B] [--sges S] [--error-every E]
 *                  [--wait]
 *
 * Setup (main thread): open the first device, one PD, per thread two CQs and a
 * connected pair of RC QPs (a -> b: RESET, INIT, RTR with the peer, RTS), a 1 MiB +
 * 4 KiB x thread buffer registered with ibv_reg_mr and a 64 KiB one with
 * ibv_reg_mr_iova; one invalid transition (thread 0's QP a, RTS -> INIT) fails.
 * Per step and thread: B receives of S sges on b, a chain of B sends of S sges on a
 * (every 4th an RDMA write, the last one signaled), an RDMA read, every E steps a send
 * with no receive posted (an RNR error completion), then polls of both CQs until
 * drained plus one empty poll each. At the end every region but thread 0's second is
 * deregistered. --wait prints "ready" before setup and "opened" after it, each time
 * waiting for a line on stdin, so a tracer can attach first; "done" at the end.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

static int steps = 100, threads = 1, batch = 8, sges = 2, error_every = 50, wait_stdin = 0;

struct worker {
    int t;
    struct ibv_cq *scq, *rcq;
    struct ibv_qp *a, *b;
    struct ibv_mr *mr, *mr2;
    char *buf;
};

static void die(const char *what)
{
    fprintf(stderr, "verbs_workload: %s failed\n", what);
    exit(1);
}

static void wait_line(const char *say)
{
    if (!wait_stdin)
        return;
    char line[64];
    printf("%s\n", say);
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin))
        exit(1);
}

static void to_state(struct ibv_qp *qp, enum ibv_qp_state s, unsigned dest)
{
    struct ibv_qp_attr attr = {.qp_state = s};
    int mask = IBV_QP_STATE;
    if (s == IBV_QPS_RTR) {
        attr.dest_qp_num = dest;
        mask |= IBV_QP_DEST_QPN;
    }
    if (ibv_modify_qp(qp, &attr, mask))
        die("ibv_modify_qp");
}

static void drain(struct ibv_cq *cq, int expect)
{
    struct ibv_wc wc[16];
    int got = 0;
    while (got < expect) {
        int n = ibv_poll_cq(cq, 16, wc);
        if (n < 0)
            die("ibv_poll_cq");
        got += n;
    }
    if (ibv_poll_cq(cq, 16, wc) != 0) /* the empty poll of a drained queue */
        die("empty poll");
}

static void *run(void *arg)
{
    struct worker *w = arg;
    struct ibv_sge sg[64 * 8];
    struct ibv_send_wr swr[64];
    struct ibv_recv_wr rwr[64];
    struct ibv_send_wr *bad_s;
    struct ibv_recv_wr *bad_r;
    int nsend = 0;
    for (int i = 0; i < batch; i++)
        nsend += i % 4 != 3;
    for (int step = 0; step < steps; step++) {
        int k = 0;
        /* receives: one per SEND below, 4 KiB each, split over the sges */
        for (int i = 0; i < nsend; i++) {
            rwr[i] = (struct ibv_recv_wr){.wr_id = i, .sg_list = &sg[k], .num_sge = sges,
                                          .next = i + 1 < nsend ? &rwr[i + 1] : NULL};
            for (int s = 0; s < sges; s++, k++)
                sg[k] = (struct ibv_sge){.addr = (uintptr_t)w->buf, .length = 4096 / sges,
                                         .lkey = w->mr->lkey};
        }
        if (ibv_post_recv(w->b, rwr, &bad_r))
            die("ibv_post_recv");
        k = 0;
        for (int i = 0; i < batch; i++) {
            swr[i] = (struct ibv_send_wr){
                .wr_id = i, .sg_list = &sg[k], .num_sge = sges,
                .opcode = i % 4 == 3 ? IBV_WR_RDMA_WRITE : IBV_WR_SEND,
                .send_flags = i + 1 == batch ? IBV_SEND_SIGNALED : 0,
                .next = i + 1 < batch ? &swr[i + 1] : NULL};
            for (int s = 0; s < sges; s++, k++)
                sg[k] = (struct ibv_sge){.addr = (uintptr_t)w->buf,
                                         .length = 64 * (i + 1) + 8 * s + step % 7,
                                         .lkey = w->mr->lkey};
        }
        if (ibv_post_send(w->a, swr, &bad_s))
            die("ibv_post_send");
        struct ibv_sge rs = {.addr = (uintptr_t)w->buf, .length = 512, .lkey = w->mr->lkey};
        struct ibv_send_wr rd = {.wr_id = 100, .sg_list = &rs, .num_sge = 1,
                                 .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED};
        if (ibv_post_send(w->a, &rd, &bad_s))
            die("ibv_post_send read");
        int expect = 2;
        if (error_every && step % error_every == error_every - 1) {
            struct ibv_send_wr lost = {.wr_id = 200, .sg_list = &rs, .num_sge = 1,
                                       .opcode = IBV_WR_SEND};
            if (ibv_post_send(w->a, &lost, &bad_s))
                die("ibv_post_send rnr");
            expect++;
        }
        drain(w->scq, expect);
        drain(w->rcq, nsend);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc)
            batch = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--sges") && i + 1 < argc)
            sges = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--error-every") && i + 1 < argc)
            error_every = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--wait"))
            wait_stdin = 1;
        else {
            fprintf(stderr, "usage: see the comment at the top of verbs_workload.c\n");
            return 2;
        }
    }
    if (batch < 1 || batch > 64 || sges < 1 || sges > 8 || threads < 1)
        die("arguments (batch 1..64, sges 1..8)");
    wait_line("ready");
    int ndev = 0;
    struct ibv_device **devs = ibv_get_device_list(&ndev);
    if (!devs || ndev < 1)
        die("ibv_get_device_list");
    struct ibv_context *ctx = ibv_open_device(devs[0]);
    if (!ctx)
        die("ibv_open_device");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct worker *w = calloc(threads, sizeof(*w));
    for (int t = 0; t < threads; t++) {
        w[t].t = t;
        w[t].scq = ibv_create_cq(ctx, 4096, NULL, NULL, 0);
        w[t].rcq = ibv_create_cq(ctx, 4096, NULL, NULL, 0);
        struct ibv_qp_init_attr ia = {.send_cq = w[t].scq, .recv_cq = w[t].rcq,
                                      .qp_type = IBV_QPT_RC,
                                      .cap = {.max_send_wr = 1024, .max_recv_wr = 1024,
                                              .max_send_sge = 8, .max_recv_sge = 8}};
        w[t].a = ibv_create_qp(pd, &ia);
        w[t].b = ibv_create_qp(pd, &ia);
        if (!w[t].a || !w[t].b)
            die("ibv_create_qp");
        size_t size = (1 << 20) + 4096 * t;
        w[t].buf = calloc(1, size);
        w[t].mr = ibv_reg_mr(pd, w[t].buf, size, IBV_ACCESS_LOCAL_WRITE);
        w[t].mr2 = ibv_reg_mr_iova(pd, w[t].buf, 65536, 0x10000, IBV_ACCESS_LOCAL_WRITE);
        if (!w[t].mr || !w[t].mr2)
            die("ibv_reg_mr");
        to_state(w[t].a, IBV_QPS_INIT, 0);
        to_state(w[t].b, IBV_QPS_INIT, 0);
        to_state(w[t].a, IBV_QPS_RTR, w[t].b->qp_num);
        to_state(w[t].b, IBV_QPS_RTR, w[t].a->qp_num);
        to_state(w[t].a, IBV_QPS_RTS, 0);
        to_state(w[t].b, IBV_QPS_RTS, 0);
    }
    struct ibv_qp_attr back = {.qp_state = IBV_QPS_INIT};
    if (ibv_modify_qp(w[0].a, &back, IBV_QP_STATE) == 0)
        die("the invalid transition RTS -> INIT to fail: ibv_modify_qp");
    wait_line("opened");
    pthread_t *tids = calloc(threads, sizeof(*tids));
    for (int t = 0; t < threads; t++)
        pthread_create(&tids[t], NULL, run, &w[t]);
    for (int t = 0; t < threads; t++)
        pthread_join(tids[t], NULL);
    for (int t = 0; t < threads; t++) {
        ibv_dereg_mr(w[t].mr);
        if (t)
            ibv_dereg_mr(w[t].mr2);
    }
    printf("done\n");
    fflush(stdout);
    ibv_free_device_list(devs);
    return 0;
}
