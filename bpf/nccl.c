/*
 * NCCL uprobes (libnccl.so.2). Collectives are enqueued a few times per model step,
 * so each call is one record: op, element count and type (bytes = count x size),
 * communicator, stream, and for ncclCommInitRank the rank, size and unique id that
 * join the ranks of one job. The enqueue is timed; the collective itself runs on the
 * stream and its GPU time shows up in the sync waits of the CUDA bursts.
 */

BPF_HASH(nccl_inflight, u64, struct tt_nccl, 4096);

/* x86-64: arguments past the sixth are on the stack above the return address. */
static __always_inline u64 stack_arg(struct pt_regs *ctx, int n)
{
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 6)));
    return v;
}

/* Record a call's arguments until it returns; the in-flight record, or NULL. */
static __always_inline struct tt_nccl *nccl_begin(u16 op, u64 elems, u64 dtype, u64 comm,
                                                   u64 stream, s32 peer)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return NULL;
    struct tt_nccl r = {};
    r.kind = TT_KIND_NCCL;
    r.pid = id >> 32;
    r.tid = (u32)id;
    r.op = op;
    r.dtype = dtype;
    r.ts_enter = bpf_ktime_get_ns();
    r.count = elems;
    r.comm = comm;
    r.stream = stream;
    r.peer = peer;
    if (nccl_inflight.update(&id, &r) != 0) {
        count(TT_CNT_INFLIGHT_FULL);
        return NULL;
    }
    return nccl_inflight.lookup(&id);
}

static __always_inline int nccl_enter(struct pt_regs *ctx, u16 op, u64 elems, u64 dtype,
                                      u64 comm, u64 stream, s32 peer)
{
#ifdef TT_STACKS
    if (nccl_begin(op, elems, dtype, comm, stream, peer)) {
        u64 id = bpf_get_current_pid_tgid();
        u32 tid = (u32)id;
        struct tt_kburst *b = bursts.lookup(&tid); /* its samples ride with this burst */
        stacks_call(ctx, id, TT_STK_NCCL + op, 0, b ? b->first_ts : 0);
    }
#else
    nccl_begin(op, elems, dtype, comm, stream, peer);
#endif
    return 0;
}

/* ncclAllReduce(send, recv, count, dtype, op, comm, stream) */
int tt_nccl_allreduce(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_ALLREDUCE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                           PT_REGS_PARM6(ctx), stack_arg(ctx, 7), -1);
}
/* ncclAllGather(send, recv, sendcount, dtype, comm, stream) */
int tt_nccl_allgather(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_ALLGATHER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                           PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), -1);
}
/* ncclReduceScatter(send, recv, recvcount, dtype, op, comm, stream) */
int tt_nccl_reducescatter(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_REDUCESCATTER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                           PT_REGS_PARM6(ctx), stack_arg(ctx, 7), -1);
}
/* ncclBroadcast(send, recv, count, dtype, root, comm, stream) */
int tt_nccl_broadcast(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_BROADCAST, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                           PT_REGS_PARM6(ctx), stack_arg(ctx, 7), (s32)PT_REGS_PARM5(ctx));
}
/* ncclReduce(send, recv, count, dtype, op, root, comm, stream) */
int tt_nccl_reduce(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_REDUCE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                           stack_arg(ctx, 7), stack_arg(ctx, 8), (s32)PT_REGS_PARM6(ctx));
}
/* ncclSend / ncclRecv(buf, count, dtype, peer, comm, stream) */
int tt_nccl_send(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_SEND, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                           PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), (s32)PT_REGS_PARM4(ctx));
}
int tt_nccl_recv(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_RECV, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                           PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), (s32)PT_REGS_PARM4(ctx));
}
int tt_nccl_group_start(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_GROUP_START, 0, 0, 0, 0, -1);
}
int tt_nccl_group_end(struct pt_regs *ctx)
{
    return nccl_enter(ctx, TT_NCCL_GROUP_END, 0, 0, 0, 0, -1);
}

/* ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank): the
 * 128-byte id is passed by value, in memory on the stack (first 8 bytes read here),
 * so rank is the third integer register. The comm handle is read at return. */
int tt_nccl_comm_init(struct pt_regs *ctx)
{
    /* comm holds the out pointer until return */
    struct tt_nccl *r = nccl_begin(TT_NCCL_COMM_INIT, 0, 0, PT_REGS_PARM1(ctx), 0,
                                   (s32)PT_REGS_PARM3(ctx));
    if (r) {
        r->nranks = (s32)PT_REGS_PARM2(ctx);
        r->comm_id = stack_arg(ctx, 7);
    }
    return 0;
}

int tt_nccl_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct tt_nccl *r = nccl_inflight.lookup(&id);
    if (!r)
        return 0;
    r->ts_exit = bpf_ktime_get_ns();
    r->ret = PT_REGS_RC(ctx);
    if (r->op == TT_NCCL_COMM_INIT) {
        u64 comm = 0;
        bpf_probe_read_user(&comm, sizeof(comm), (void *)r->comm);
        r->comm = comm;
    }
    submit(r, sizeof(*r), TT_CNT_LOST_GPU);
    nccl_inflight.delete(&id);
    return 0;
}
