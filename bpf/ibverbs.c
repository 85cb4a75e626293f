/*
 * ibverbs uprobes. ibv_post_send, ibv_post_recv and ibv_poll_cq are static inline in
 * verbs.h: they jump through ctx->ops (struct ibv_context_ops) into the provider
 * library (libmlx5, librxe, ...), whose functions are not exported. So the exported
 * calls that hand us a device context (ibv_open_device's return, or the context of the
 * pd/qp/mr/cq a later call passes) send its three ops pointers to user space once per
 * context (a VERBS_CTX record); tracer/probes/ibverbs.py resolves each to a file and
 * offset through /proc/PID/maps and attaches the handlers below there.
 *
 * Posts and polls run at message rate, so they are counted here per (process, thread,
 * QP, op, opcode) in `verbs_counts`, which user space reads on a timer: Python does no
 * per-post work. Registrations and QP state changes are rare and sent one by one.
 *
 * The TT_VERBS_OFF_* offsets are x86-64 offsets in the real <infiniband/verbs.h> (the
 * rdma-core ABI, stable since libibverbs 1.1); samples/gpu/standin/verbs_abi_check.c
 * proves each against the installed header at build time.
 */
#define TT_VERBS_OFF_CTX_POLL_CQ 96    /* offsetof(struct ibv_context, ops.poll_cq) */
#define TT_VERBS_OFF_CTX_POST_SEND 208 /* offsetof(struct ibv_context, ops.post_send) */
#define TT_VERBS_OFF_CTX_POST_RECV 216 /* offsetof(struct ibv_context, ops.post_recv) */
#define TT_VERBS_OFF_OBJ_CONTEXT 0     /* ibv_pd/ibv_qp/ibv_cq/ibv_mr.context */
#define TT_VERBS_OFF_QP_NUM 52         /* struct ibv_qp.qp_num */
#define TT_VERBS_OFF_MR_ADDR 16        /* struct ibv_mr.addr */
#define TT_VERBS_OFF_MR_LENGTH 24      /* struct ibv_mr.length */
#define TT_VERBS_OFF_MR_LKEY 36        /* struct ibv_mr.lkey */
#define TT_VERBS_OFF_MR_RKEY 40        /* struct ibv_mr.rkey */
#define TT_VERBS_OFF_WR_NEXT 8         /* ibv_send_wr/ibv_recv_wr.next */
#define TT_VERBS_OFF_WR_SG_LIST 16     /* ibv_send_wr/ibv_recv_wr.sg_list */
#define TT_VERBS_OFF_WR_NUM_SGE 24     /* ibv_send_wr/ibv_recv_wr.num_sge */
#define TT_VERBS_OFF_WR_OPCODE 28      /* ibv_send_wr.opcode */
#define TT_VERBS_SGE_SIZE 16           /* sizeof(struct ibv_sge) */
#define TT_VERBS_OFF_SGE_LENGTH 8      /* struct ibv_sge.length */
#define TT_VERBS_WC_SIZE 48            /* sizeof(struct ibv_wc) */
#define TT_VERBS_OFF_WC_STATUS 8       /* struct ibv_wc.status */
#define TT_VERBS_OFF_WC_OPCODE 12      /* struct ibv_wc.opcode */
#define TT_VERBS_OFF_WC_BYTE_LEN 20    /* struct ibv_wc.byte_len */
#define TT_VERBS_OFF_WC_QP_NUM 28      /* struct ibv_wc.qp_num */
#define TT_VERBS_OFF_ATTR_QP_STATE 0   /* struct ibv_qp_attr.qp_state */
#define TT_VERBS_OFF_ATTR_DEST_QPN 28  /* struct ibv_qp_attr.dest_qp_num */
#define TT_VERBS_IBV_QP_STATE 1        /* enum ibv_qp_attr_mask */
#define TT_VERBS_IBV_QP_DEST_QPN 1048576
#define TT_VERBS_IBV_WC_RECV 128       /* enum ibv_wc_opcode: receive completions have it */

/* The head of ibv_send_wr / ibv_recv_wr, read in one go (opcode: send only). */
struct verbs_wr {
    u64 wr_id;
    u64 next;
    u64 sg_list;
    s32 num_sge;
    u32 opcode;
};
/* ibv_wc from .status to .qp_num */
struct verbs_wc {
    u32 status;
    u32 opcode;
    u32 vendor_err;
    u32 byte_len;
    u32 imm_data;
    u32 qp_num;
};
_Static_assert(__builtin_offsetof(struct verbs_wr, next) == TT_VERBS_OFF_WR_NEXT, "wr.next");
_Static_assert(__builtin_offsetof(struct verbs_wr, sg_list) == TT_VERBS_OFF_WR_SG_LIST, "sg_list");
_Static_assert(__builtin_offsetof(struct verbs_wr, num_sge) == TT_VERBS_OFF_WR_NUM_SGE, "num_sge");
_Static_assert(__builtin_offsetof(struct verbs_wr, opcode) == TT_VERBS_OFF_WR_OPCODE, "opcode");
_Static_assert(TT_VERBS_OFF_WC_STATUS + __builtin_offsetof(struct verbs_wc, byte_len) ==
               TT_VERBS_OFF_WC_BYTE_LEN, "wc.byte_len");
_Static_assert(TT_VERBS_OFF_WC_STATUS + __builtin_offsetof(struct verbs_wc, qp_num) ==
               TT_VERBS_OFF_WC_QP_NUM, "wc.qp_num");

struct verbs_key {
    u32 pid;
    u32 tid;
    u32 qp_num;
    u16 op;     /* TT_VERBS_* */
    u16 opcode; /* ibv_wr_opcode / ibv_wc_opcode / 0 */
};
struct verbs_val {
    u64 count;
    u64 bytes;
    u64 errors;
    u64 extra;
};
/* Cumulative counters; user space sends what changed as VERBS records and deletes the
 * entries of threads that have exited. */
BPF_HASH(verbs_counts, struct verbs_key, struct verbs_val, 65536);

static __always_inline void verbs_add(u64 id, u32 qp_num, u16 op, u16 opcode, u64 n,
                                      u64 bytes, u64 errors, u64 extra)
{
    struct verbs_key k = {.pid = id >> 32, .tid = (u32)id, .qp_num = qp_num, .op = op,
                          .opcode = opcode};
    struct verbs_val zero = {};
    struct verbs_val *v = verbs_counts.lookup_or_try_init(&k, &zero);
    if (!v) {
        count(TT_CNT_VERBS_FULL);
        return;
    }
    /* one thread updates its own keys and a handler is never preempted by another
     * run of itself on that thread: no atomics needed */
    v->count += n;
    v->bytes += bytes;
    v->errors += errors;
    v->extra += extra;
}

/* ---- device contexts: where the provider's functions are --------------------- */

struct verbs_ctx_key {
    u32 pid;
    u32 pad;
    u64 ctx;
};
BPF_HASH(verbs_contexts, struct verbs_ctx_key, u32, 4096);

static __always_inline void verbs_learn(u64 id, u64 ctxp, u16 via)
{
    if (!ctxp)
        return;
    struct verbs_ctx_key k = {.pid = id >> 32, .ctx = ctxp};
    if (verbs_contexts.lookup(&k))
        return;
    u32 one = 1;
    if (verbs_contexts.update(&k, &one) != 0) {
        count(TT_CNT_VERBS_FULL);
        return;
    }
    struct tt_verbs_ctx r = {};
    r.kind = TT_KIND_VERBS_CTX;
    r.pid = id >> 32;
    r.tid = (u32)id;
    r.via = via;
    r.ts = bpf_ktime_get_ns();
    r.ctx = ctxp;
    bpf_probe_read_user(&r.post_send, 8, (void *)(ctxp + TT_VERBS_OFF_CTX_POST_SEND));
    bpf_probe_read_user(&r.post_recv, 8, (void *)(ctxp + TT_VERBS_OFF_CTX_POST_RECV));
    bpf_probe_read_user(&r.poll_cq, 8, (void *)(ctxp + TT_VERBS_OFF_CTX_POLL_CQ));
    /* Woken at once: every post before the provider probes attach goes uncounted.
     * A lost record is retried at the context's next exported call. */
    if (ring_out(&r, sizeof(r), BPF_RB_FORCE_WAKEUP) != 0) {
        count(TT_CNT_LOST_GPU);
        verbs_contexts.delete(&k);
    }
}

/* the context of an object whose first field is `struct ibv_context *context` */
static __always_inline void verbs_learn_from(u64 id, u64 obj, u16 via)
{
    u64 ctxp = 0;
    if (obj && bpf_probe_read_user(&ctxp, 8, (void *)(obj + TT_VERBS_OFF_OBJ_CONTEXT)) == 0)
        verbs_learn(id, ctxp, via);
}

static __always_inline int verbs_ctx_return(struct pt_regs *ctx, u16 via)
{
    u64 id = bpf_get_current_pid_tgid();
    if (is_traced(id >> 32))
        verbs_learn(id, PT_REGS_RC(ctx), via);
    return 0;
}
/* ibv_open_device(device) / ibv_import_device(cmd_fd): return the context */
int tt_verbs_open_device_return(struct pt_regs *ctx)
{
    return verbs_ctx_return(ctx, TT_VERBS_VIA_OPEN_DEVICE);
}
int tt_verbs_import_device_return(struct pt_regs *ctx)
{
    return verbs_ctx_return(ctx, TT_VERBS_VIA_IMPORT_DEVICE);
}
/* ibv_ack_cq_events(cq, nevents): event-driven consumers call it per batch */
int tt_verbs_ack_cq_events(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (is_traced(id >> 32))
        verbs_learn_from(id, PT_REGS_PARM1(ctx), TT_VERBS_VIA_ACK_CQ_EVENTS);
    return 0;
}

/* ---- data path (provider functions, attached by address) --------------------- */

/*
 * provider post_send / post_recv (qp, wr, bad_wr): walk the chain, count per opcode.
 * One flat loop over work requests and their sges (nested loops cost the verifier the
 * product of both bounds): each step reads either the next sge or the next wr. The
 * run counters (n, bytes, sges, cut) are never branched on, so the verifier can prune
 * states that differ only in them; branching on them makes loading fail (E2BIG).
 */
static __always_inline int verbs_post(struct pt_regs *ctx, int send)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    u64 qp = PT_REGS_PARM1(ctx);
    u64 wr = PT_REGS_PARM2(ctx);
    u32 qp_num = 0;
    bpf_probe_read_user(&qp_num, sizeof(qp_num), (void *)(qp + TT_VERBS_OFF_QP_NUM));
    u16 op = send ? TT_VERBS_SEND : TT_VERBS_RECV;
    u16 call = send ? TT_VERBS_POST_SEND_CALL : TT_VERBS_POST_RECV_CALL;
    struct verbs_wr h = {};
    if (!wr || bpf_probe_read_user(&h, sizeof(h), (void *)wr) < 0) {
        verbs_add(id, qp_num, call, 0, 1, 0, 0, wr != 0);
        return 0;
    }
    u16 cur = send ? (u16)h.opcode : 0;
    u64 n = 1, bytes = 0, cut = 0;
    u64 sges = h.num_sge > 0 ? h.num_sge : 0;
    u64 sg = h.sg_list;
    u32 left = h.num_sge > 0 ? h.num_sge : 0; /* sges of the current wr still to read */
    if (left > TT_VERBS_MAX_SGE) {
        left = TT_VERBS_MAX_SGE;
        cut = 1;
    }
    wr = h.next;
    for (int i = 0; i < TT_VERBS_MAX_STEPS; i++) {
        if (left) {
            u32 len = 0;
            cut |= bpf_probe_read_user(&len, sizeof(len),
                                       (void *)(sg + TT_VERBS_OFF_SGE_LENGTH)) != 0;
            bytes += len;
            sg += TT_VERBS_SGE_SIZE;
            left--;
            continue;
        }
        if (!wr)
            break;
        if (bpf_probe_read_user(&h, sizeof(h), (void *)wr) < 0) {
            cut = 1;
            wr = 0;
            break;
        }
        u16 opcode = send ? (u16)h.opcode : 0;
        if (opcode != cur) { /* runs of one opcode cost one map update */
            verbs_add(id, qp_num, op, cur, n, bytes, 0, sges);
            n = bytes = sges = 0;
            cur = opcode;
        }
        n++;
        sges += h.num_sge > 0 ? h.num_sge : 0;
        left = h.num_sge > 0 ? h.num_sge : 0;
        if (left > TT_VERBS_MAX_SGE) {
            left = TT_VERBS_MAX_SGE;
            cut = 1;
        }
        sg = h.sg_list;
        wr = h.next;
    }
    if (wr || left) /* more than TT_VERBS_MAX_STEPS reads */
        cut = 1;
    verbs_add(id, qp_num, op, cur, n, bytes, 0, sges);
    verbs_add(id, qp_num, call, 0, 1, 0, 0, cut);
    count_n(TT_CNT_VERBS_CUT, cut);
    return 0;
}
int tt_verbs_post_send(struct pt_regs *ctx) { return verbs_post(ctx, 1); }
int tt_verbs_post_recv(struct pt_regs *ctx) { return verbs_post(ctx, 0); }

BPF_HASH(verbs_poll_inflight, u64, u64, 16384); /* pid_tgid -> wc array */

/* provider poll_cq(cq, num_entries, wc) */
int tt_verbs_poll_cq(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    u64 wc = PT_REGS_PARM3(ctx);
    if (verbs_poll_inflight.update(&id, &wc) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

int tt_verbs_poll_cq_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 *wcp = verbs_poll_inflight.lookup(&id);
    if (!wcp)
        return 0;
    u64 wc = *wcp;
    verbs_poll_inflight.delete(&id);
    int ret = (int)PT_REGS_RC(ctx);
    if (ret < 0) {
        verbs_add(id, 0, TT_VERBS_POLL, 0, 1, 0, 1, 0);
        return 0;
    }
    verbs_add(id, 0, TT_VERBS_POLL, 0, 1, 0, 0, ret == 0);
    if (ret == 0)
        return 0;
    /* completions, as in verbs_post: runs of one (qp, opcode) cost one map update, and
     * the run counters are never branched on */
    struct verbs_wc w = {};
    int done = 0; /* completions read */
    u32 cur_qp = 0;
    u16 cur_op = 0;
    u64 n = 0, bytes = 0, errors = 0;
    if (bpf_probe_read_user(&w, sizeof(w), (void *)(wc + TT_VERBS_OFF_WC_STATUS)) == 0) {
        done = 1;
        cur_qp = w.qp_num;
        cur_op = w.status ? TT_VERBS_OPCODE_ERROR : (u16)w.opcode;
        n = 1;
        errors = w.status != 0;
        bytes = (!w.status && (w.opcode & TT_VERBS_IBV_WC_RECV)) ? w.byte_len : 0;
        for (int i = 1; i < TT_VERBS_MAX_WC; i++) {
            if (i >= ret)
                break;
            if (bpf_probe_read_user(&w, sizeof(w), (void *)(wc + i * TT_VERBS_WC_SIZE +
                                                            TT_VERBS_OFF_WC_STATUS)) < 0)
                break;
            done = i + 1;
            u16 opcode = w.status ? TT_VERBS_OPCODE_ERROR : (u16)w.opcode;
            if (w.qp_num != cur_qp || opcode != cur_op) {
                verbs_add(id, cur_qp, TT_VERBS_CQE, cur_op, n, bytes, errors, 0);
                n = bytes = errors = 0;
                cur_qp = w.qp_num;
                cur_op = opcode;
            }
            n++;
            errors += w.status != 0;
            bytes += (!w.status && (w.opcode & TT_VERBS_IBV_WC_RECV)) ? w.byte_len : 0;
        }
        verbs_add(id, cur_qp, TT_VERBS_CQE, cur_op, n, bytes, errors, 0);
    }
    if (ret > done) {
        /* completions past what was read: counted, their qp, status and bytes unknown */
        verbs_add(id, 0, TT_VERBS_CQE, TT_VERBS_OPCODE_UNREAD, ret - done, 0, 0, 0);
        count(TT_CNT_VERBS_CUT);
    }
    return 0;
}

/* ---- memory registration and QP state (rare: one record each) ---------------- */

BPF_HASH(verbs_mr_inflight, u64, struct tt_verbs_mr, 1024);

static __always_inline int verbs_mr_enter(u64 pd, u64 addr, u64 length, s32 access)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    verbs_learn_from(id, pd, TT_VERBS_VIA_REG_MR);
    struct tt_verbs_mr r = {};
    r.kind = TT_KIND_VERBS_MR;
    r.pid = id >> 32;
    r.tid = (u32)id;
    r.op = TT_VERBS_REG_MR;
    r.ts = bpf_ktime_get_ns();
    r.addr = addr;
    r.length = length;
    r.access = access;
    if (verbs_mr_inflight.update(&id, &r) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}
/* ibv_reg_mr_iova2(pd, addr, length, iova, access): ibv_reg_mr and ibv_reg_mr_iova
 * call it (real libibverbs >= 1.8), so it alone counts each registration once */
int tt_verbs_reg_mr_iova2(struct pt_regs *ctx)
{
    return verbs_mr_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                          (s32)PT_REGS_PARM5(ctx));
}
/* ibv_reg_mr(pd, addr, length, access): probed only where iova2 does not exist */
int tt_verbs_reg_mr(struct pt_regs *ctx)
{
    return verbs_mr_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                          (s32)PT_REGS_PARM4(ctx));
}
/* ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access): addr is the iova */
int tt_verbs_reg_dmabuf_mr(struct pt_regs *ctx)
{
    return verbs_mr_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM3(ctx),
                          (s32)PT_REGS_PARM6(ctx));
}

/* ibv_dereg_mr(mr): the region's address and size are read before it is gone */
int tt_verbs_dereg_mr(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    u64 mr = PT_REGS_PARM1(ctx);
    verbs_learn_from(id, mr, TT_VERBS_VIA_DEREG_MR);
    struct tt_verbs_mr r = {};
    r.kind = TT_KIND_VERBS_MR;
    r.pid = id >> 32;
    r.tid = (u32)id;
    r.op = TT_VERBS_DEREG_MR;
    r.ts = bpf_ktime_get_ns();
    r.mr = mr;
    bpf_probe_read_user(&r.addr, 8, (void *)(mr + TT_VERBS_OFF_MR_ADDR));
    bpf_probe_read_user(&r.length, 8, (void *)(mr + TT_VERBS_OFF_MR_LENGTH));
    bpf_probe_read_user(&r.lkey, 4, (void *)(mr + TT_VERBS_OFF_MR_LKEY));
    bpf_probe_read_user(&r.rkey, 4, (void *)(mr + TT_VERBS_OFF_MR_RKEY));
    if (verbs_mr_inflight.update(&id, &r) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

int tt_verbs_mr_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct tt_verbs_mr *r = verbs_mr_inflight.lookup(&id);
    if (!r)
        return 0;
    u64 rc = PT_REGS_RC(ctx);
    if (r->op == TT_VERBS_REG_MR) {
        r->mr = rc;
        r->ret = rc ? 0 : -1;
        if (rc) {
            bpf_probe_read_user(&r->lkey, 4, (void *)(rc + TT_VERBS_OFF_MR_LKEY));
            bpf_probe_read_user(&r->rkey, 4, (void *)(rc + TT_VERBS_OFF_MR_RKEY));
        }
    } else {
        r->ret = (s32)rc;
    }
    r->ts = bpf_ktime_get_ns();
    submit(r, sizeof(*r), TT_CNT_LOST_GPU);
    verbs_mr_inflight.delete(&id);
    return 0;
}

BPF_HASH(verbs_qp_inflight, u64, struct tt_verbs_qp, 1024);

/* ibv_modify_qp(qp, attr, attr_mask): the requested state and remote QP */
int tt_verbs_modify_qp(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    u64 qp = PT_REGS_PARM1(ctx);
    u64 attr = PT_REGS_PARM2(ctx);
    s32 mask = (s32)PT_REGS_PARM3(ctx);
    verbs_learn_from(id, qp, TT_VERBS_VIA_MODIFY_QP);
    struct tt_verbs_qp r = {};
    r.kind = TT_KIND_VERBS_QP;
    r.pid = id >> 32;
    r.tid = (u32)id;
    r.attr_mask = mask;
    r.state = -1;
    r.dest_qp_num = -1;
    bpf_probe_read_user(&r.qp_num, 4, (void *)(qp + TT_VERBS_OFF_QP_NUM));
    if (mask & TT_VERBS_IBV_QP_STATE)
        bpf_probe_read_user(&r.state, 4, (void *)(attr + TT_VERBS_OFF_ATTR_QP_STATE));
    if (mask & TT_VERBS_IBV_QP_DEST_QPN)
        bpf_probe_read_user(&r.dest_qp_num, 4, (void *)(attr + TT_VERBS_OFF_ATTR_DEST_QPN));
    if (verbs_qp_inflight.update(&id, &r) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

int tt_verbs_modify_qp_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct tt_verbs_qp *r = verbs_qp_inflight.lookup(&id);
    if (!r)
        return 0;
    r->ret = (s32)PT_REGS_RC(ctx);
    r->ts = bpf_ktime_get_ns();
    submit(r, sizeof(*r), TT_CNT_LOST_GPU);
    verbs_qp_inflight.delete(&id);
    return 0;
}
