/*
 * CUDA driver API uprobes (libcuda.so.1). The runtime, cuBLAS, cuDNN and Triton all
 * launch through these entry points, so each launch is counted exactly once here
 * (never count at cudaLaunchKernel as well: that double-counts; its probes below only
 * learn host stubs).
 *
 * Launches, copies and memsets happen tens of thousands of times a second, so they
 * are summed per thread in `bursts` (a struct tt_kburst per thread) and sent as one
 * record when the thread synchronises (at most once per TT_CFG_BURST_MIN_NS when that
 * is set: each record costs the agent ~10 us), when a query finds its work done, after
 * TT_CFG_BURST_NS, when the thread exits, or, while --gpu-sample has the syncs off, at
 * the device-to-host copy that brings a step's results back. A burst's first
 * TT_BURST_SLOTS_N distinct kernels are counted in it; launches of further kernels are
 * counted in the burst's total and, per kernel, in `kernel_counts`, which user space
 * reads on a timer (KCOUNT records), so a step with many distinct kernels does not cost
 * a record per 16 of them. Python never sees a single launch. Name resolution,
 * allocations and frees are rare and sent one by one.
 *
 * tracer/probes/gpu.py attaches each exported symbol to the handler named in its
 * table; the handlers below are named by what they read from the arguments.
 */

BPF_HASH(bursts, u32, struct tt_kburst, 16384);

struct kcount_key {
    u32 pid;
    u32 tid;
    u64 handle;
};
/* launches of kernels that found a thread's burst slots full: cumulative, read and
 * pruned of exited threads by tracer/probes/gpu.py */
BPF_HASH(kernel_counts, struct kcount_key, u64, 65536);
BPF_PERCPU_ARRAY(burst_zero, struct tt_kburst, 1); /* never written: the empty burst */

/* The thread's open burst, opened at `now` if it has none. A thread's entry stays in
 * `bursts` between its bursts, emptied by flush() (first_ts 0: none open), so that a
 * step's first call does not insert it again (see flush). */
static __always_inline struct tt_kburst *burst_of(u64 id, u64 now)
{
    u32 tid = (u32)id;
    struct tt_kburst *b = bursts.lookup(&tid);
    if (b) {
        if (!b->first_ts)
            b->first_ts = now;
        return b;
    }
    u32 zero = 0;
    struct tt_kburst *z = burst_zero.lookup(&zero);
    if (!z)
        return NULL;
    if (bursts.update(&tid, z) != 0) {
        count(TT_CNT_BURSTS_FULL);
        return NULL;
    }
    b = bursts.lookup(&tid);
    if (b) {
        b->kind = TT_KIND_KBURST;
        b->pid = id >> 32;
        b->tid = tid;
        b->first_ts = now;
    }
    return b;
}

/* Send the burst and empty its entry in place: deleting the entry here and inserting
 * it again at the step's next call was a third of that first call's BPF time on the
 * development VM (docs/overhead.md, "a burst's entry kept between steps"). */
static __always_inline void flush(u32 tid, struct tt_kburst *b, u16 reason)
{
    b->reason = reason;
#ifdef TT_STACKS
    stacks_flush(tid); /* the burst's sampled stacks go right before it (bpf/stacks.c) */
#endif
    submit(b, sizeof(*b), TT_CNT_LOST_GPU);
    b->reason = 0;
    b->sync_api = 0;
    __builtin_memset(&b->first_ts, 0,
                     sizeof(*b) - __builtin_offsetof(struct tt_kburst, first_ts));
}

/* the syncs' bit of the copy gate, after the copy kinds' and the memsets' */
static __always_inline int sync_gate_closed(void)
{
    return (config_get(TT_CFG_COPY_GATE_CLOSED, 0) >> (TT_COPY_KINDS + 1)) & 1;
}

/* The burst of a traced thread, ready for one more call; NULL if not traced. */
static __always_inline struct tt_kburst *begin_call(u64 id, u64 now)
{
    if (!is_traced(id >> 32))
        return NULL;
    struct tt_kburst *b = burst_of(id, now);
    if (!b)
        return NULL;
    if (now - b->first_ts > config_get(TT_CFG_BURST_NS, 10000000ULL)) {
        /* with the syncs off a result copy flushes its burst at once (on_copy), so one
         * still held here is a step whose sync went unseen as they went off: it ended */
        int ended = b->copy_calls[TT_COPY_D2H] && sync_gate_closed();
        flush((u32)id, b, ended ? TT_BURST_COPY : TT_BURST_INTERVAL);
        b = burst_of(id, now);
    }
    return b;
}

/* ---- kernel names from the runtime's host stubs ----------------------------------
 *
 * A handle resolved before the tracer attached (lazy loading resolves each kernel at
 * its first launch; a warmed-up server resolved them all) never passes the name probes
 * below. But cudaLaunchKernel*(func, ...) in libcudart receives func = the address of
 * nvcc's host stub, a host function whose symbol is the kernel's own mangled name, and
 * then calls cuLaunchKernel* with the handle on the same thread. So: the runtime's
 * entry probe leaves func pending for the thread, the driver's launch probe takes it
 * and sends (handle, stub) once per process and handle (KSTUB), and user space finds
 * the symbol (tracer/probes/symbols.py). The runtime probes count nothing (the driver's
 * count every launch) and user space detaches them once naming has gone quiet.
 */
struct stub_pending {
    u64 stub;
    u64 sp;  /* stack pointer at the runtime call's entry: its return address's slot */
    u64 ret; /* that return address, to tell a live runtime frame from a returned one */
};
BPF_HASH(stub_pending, u32, struct stub_pending, 16384); /* tid -> pending stub */

struct stub_key {
    u32 pid;
    u32 pad;
    u64 handle;
};
/* (pid, handle) already sent, or named live by the name probes further down: a set,
 * pruned of exited processes by user space */
BPF_HASH(stub_sent, struct stub_key, u8, 65536);
/* runtime launch calls seen: user space closes naming after a stretch of launches with
 * no new stub, and must tell that from a process that launches nothing (idle) */
BPF_PERCPU_ARRAY(stub_calls, u64, 1);

static __always_inline int stub_enter(struct pt_regs *ctx, u64 stub)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    struct stub_pending p = {.stub = stub, .sp = PT_REGS_SP(ctx)};
#if defined(bpf_target_x86) /* elsewhere (arm64: in a register) only the sp test holds */
    /* at a function's first instruction the return address is at the stack pointer */
    bpf_probe_read_user(&p.ret, sizeof(p.ret), (void *)p.sp);
#endif
    u32 tid = (u32)id;
    if (stub_pending.update(&tid, &p) != 0)
        count(TT_CNT_STUBS_FULL);
    u32 zero = 0;
    u64 *calls = stub_calls.lookup(&zero);
    if (calls)
        (*calls)++;
    return 0;
}

static __always_inline void stub_mark_named(u32 pid, u64 handle)
{
    struct stub_key k = {.pid = pid, .handle = handle};
    u8 one = 1;
    stub_sent.update(&k, &one); /* full: the stub may be sent too; the live name wins */
}

/* cudaLaunchKernel(func, grid, block, args, shmem, stream), _ptsz, and
 * cudaLaunchCooperativeKernel[_ptsz] (same arguments) */
int tt_stub_arg1(struct pt_regs *ctx) { return stub_enter(ctx, PT_REGS_PARM1(ctx)); }
/* cudaLaunchKernelExC[_ptsz](config, func, args) */
int tt_stub_arg2(struct pt_regs *ctx) { return stub_enter(ctx, PT_REGS_PARM2(ctx)); }

static __always_inline void stub_claim(struct pt_regs *ctx, u64 id, u64 handle, u64 now)
{
    u32 tid = (u32)id;
    struct stub_pending p = {};
    struct stub_pending *pp = stub_pending.lookup(&tid);
    if (!pp)
        goto send; /* a driver-API launch (cuBLAS, Triton): sent with no stub, for user
                    * space to name from the driver's object (tracer/probes/prenames.py) */
    p = *pp;
    stub_pending.delete(&tid);
    /* Pair only a launch made from inside the runtime call: a call that failed before
     * reaching the driver leaves its stub behind, and the thread's next launch may be
     * a driver-API one of another kernel. Inside the call (or in a tail call from it,
     * which reuses its slot) this frame is no shallower and the runtime call's return
     * address is still in its slot. Once the call has returned, a launch from a
     * shallower frame fails the first test; one from the same or a deeper frame got
     * there by later calls, which push their own return addresses over that slot. */
    if (PT_REGS_SP(ctx) > p.sp) {
        count(TT_CNT_STUB_STALE);
        return;
    }
#if defined(bpf_target_x86)
    u64 ret = 0;
    if (bpf_probe_read_user(&ret, sizeof(ret), (void *)p.sp) != 0 || ret != p.ret) {
        count(TT_CNT_STUB_STALE);
        return;
    }
#endif
send:;
    struct stub_key k = {.pid = id >> 32, .handle = handle};
    if (stub_sent.lookup(&k))
        return; /* the steady state: sent before, or named by the driver */
    u8 one = 1;
    int err = stub_sent.insert(&k, &one);
    if (err == -EEXIST)
        return; /* another thread sent it just now */
    if (err != 0) {
        count(TT_CNT_STUBS_FULL);
        return;
    }
    struct tt_kstub s = {.kind = TT_KIND_KSTUB, .pid = id >> 32, .tid = tid, .ts = now,
                         .handle = handle, .stub = p.stub};
    submit(&s, sizeof(s), TT_CNT_LOST_GPU);
}

static __always_inline int on_launch(struct pt_regs *ctx, u64 handle, int graph)
{
    /* --gpu-sample: the gate closes at once, before the (slow) detach, and opens
     * after the attach, so that what is counted is exactly the open span */
    if (config_get(TT_CFG_LAUNCH_GATE_CLOSED, 0)) {
        count(TT_CNT_GATED_CALLS);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    struct tt_kburst *b = begin_call(id, now);
    if (!b)
        return 0;
    b->last_ts = now;
#ifdef TT_STACKS
    stacks_call(ctx, id, graph ? TT_STK_GRAPH : TT_STK_KERNEL, handle, b->first_ts);
#endif
    if (graph) {
        b->graph_launches++;
        return 0;
    }
    /* an array flag (the verifier inlines its lookup): while the runtime's launch
     * probes are detached, naming costs a launch nothing more */
    if (config_get(TT_CFG_STUB_NAMING, 0))
        stub_claim(ctx, id, handle, now);
    /* find the handle's slot; a full table flushes first so counts stay exact */
    u32 n = b->nslots;
    /* Spelled out: constant offsets, which the verifier checks without the range
     * tracking a compiled loop's moving pointers defeat. */
#define TT_SLOT(i)                                                               \
    if ((i) < n && b->handles[i] == handle) {                                    \
        b->handle_counts[i]++;                                                   \
        b->launches++;                                                           \
        return 0;                                                                \
    }
    TT_SLOT(0) TT_SLOT(1) TT_SLOT(2) TT_SLOT(3) TT_SLOT(4) TT_SLOT(5) TT_SLOT(6)
    TT_SLOT(7) TT_SLOT(8) TT_SLOT(9) TT_SLOT(10) TT_SLOT(11) TT_SLOT(12) TT_SLOT(13)
    TT_SLOT(14) TT_SLOT(15)
#undef TT_SLOT
    _Static_assert(TT_BURST_SLOTS_N == 16, "one TT_SLOT line per slot");
    b->launches++;
    if (n >= TT_BURST_SLOTS_N) {
        struct kcount_key k = {.pid = id >> 32, .tid = (u32)id, .handle = handle};
        u64 zero = 0;
        u64 *c = kernel_counts.lookup_or_try_init(&k, &zero);
        if (c)
            (*c)++; /* only this thread writes its keys */
        else
            count(TT_CNT_KCOUNTS_FULL); /* the launch is counted, its kernel unknown */
        return 0;
    }
    u32 slot = n & (TT_BURST_SLOTS_N - 1); /* n < TT_BURST_SLOTS_N here; the mask proves it */
    b->handles[slot] = handle;
    b->handle_counts[slot] = 1;
    b->nslots = slot + 1;
    return 0;
}

/* cuLaunchKernel(f, ...), cuLaunchCooperativeKernel(f, ...), _ptsz variants */
int tt_launch_arg1(struct pt_regs *ctx) { return on_launch(ctx, PT_REGS_PARM1(ctx), 0); }
/* cuLaunchKernelEx(config, f, params, extra) */
int tt_launch_arg2(struct pt_regs *ctx) { return on_launch(ctx, PT_REGS_PARM2(ctx), 0); }
/* cuGraphLaunch(exec, stream) */
int tt_graph_launch(struct pt_regs *ctx) { return on_launch(ctx, PT_REGS_PARM1(ctx), 1); }

static __always_inline int on_copy(struct pt_regs *ctx, u32 kind, u64 bytes)
{
    /* Host-to-device and device-to-device copies can be sampled with the launches
     * (--gpu-sample, where the other probes tell a thread's steps apart without them:
     * SAMPLED_COPY_KINDS in tracer/events/gpu.py); then a gate of their own, a bit per
     * kind, stops their count before the detach, as the launches' does. */
    if ((config_get(TT_CFG_COPY_GATE_CLOSED, 0) >> (kind & 63)) & 1) {
        count(TT_CNT_GATED_CALLS);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    struct tt_kburst *b = begin_call(id, now);
    if (!b)
        return 0;
    if (kind == TT_COPY_D2H && b->copy_calls[TT_COPY_D2H] && sync_gate_closed()) {
        /* The burst holds the last step's result copy: the sync that would have ended
         * that step was gated off, or its return probe came out while it waited, as
         * the syncs went off. That step ended there: flushed first, this copy is the
         * next one's. */
        flush((u32)id, b, TT_BURST_COPY);
        b = burst_of(id, now);
        if (!b)
            return 0;
    }
    b->last_ts = now;
#ifdef TT_STACKS
    stacks_call(ctx, id, TT_STK_COPY + kind, 0, b->first_ts);
#endif
    if (kind < TT_COPY_KINDS) {
        b->copy_bytes[kind] += bytes;
        b->copy_calls[kind]++;
    }
    /* The syncs are off with the launch probes (--gpu-sample, SYNC_GATE in
     * tracer/events/gpu.py): the step this copy brings results back for ends here, not
     * at the sync that follows it, which nothing sees now. Whatever
     * TT_CFG_BURST_MIN_NS says: with the launches off too that is a record a step, and
     * a step's end held back would take the next one's calls. */
    if (kind == TT_COPY_D2H && sync_gate_closed())
        flush((u32)id, b, TT_BURST_COPY);
    return 0;
}

/* cuMemcpy{HtoD,DtoH,DtoD}[Async]_v2(dst, src, bytes[, stream]), cuMemcpy[Async] */
int tt_copy_h2d_arg3(struct pt_regs *ctx) { return on_copy(ctx, TT_COPY_H2D, PT_REGS_PARM3(ctx)); }
int tt_copy_d2h_arg3(struct pt_regs *ctx) { return on_copy(ctx, TT_COPY_D2H, PT_REGS_PARM3(ctx)); }
int tt_copy_d2d_arg3(struct pt_regs *ctx) { return on_copy(ctx, TT_COPY_D2D, PT_REGS_PARM3(ctx)); }
int tt_copy_other_arg3(struct pt_regs *ctx) { return on_copy(ctx, TT_COPY_OTHER, PT_REGS_PARM3(ctx)); }
/* cuMemcpyPeer[Async](dst, dstCtx, src, srcCtx, bytes[, stream]) */
int tt_copy_d2d_arg5(struct pt_regs *ctx) { return on_copy(ctx, TT_COPY_D2D, PT_REGS_PARM5(ctx)); }

static __always_inline int on_memset(u64 elems, u64 elem_size)
{
    /* memsets can be sampled with the launches too, on their own (MEMSET_GATE in
     * tracer/events/gpu.py): the gate's bit after the copy kinds' */
    if ((config_get(TT_CFG_COPY_GATE_CLOSED, 0) >> TT_COPY_KINDS) & 1) {
        count(TT_CNT_GATED_CALLS);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    struct tt_kburst *b = begin_call(id, now);
    if (!b)
        return 0;
    b->last_ts = now;
    b->memset_bytes += elems * elem_size;
    b->memset_calls++;
    return 0;
}

/* cuMemsetD{8,16,32}[Async][_v2](dst, value, N[, stream]) */
int tt_memset8_arg3(struct pt_regs *ctx) { return on_memset(PT_REGS_PARM3(ctx), 1); }
int tt_memset16_arg3(struct pt_regs *ctx) { return on_memset(PT_REGS_PARM3(ctx), 2); }
int tt_memset32_arg3(struct pt_regs *ctx) { return on_memset(PT_REGS_PARM3(ctx), 4); }

/* ---- synchronisation: time the wait, then flush the burst it ends -------------
 *
 * An engine's step ends at the sync that brings its results back: the one whose burst
 * copied device-to-host (tracer/correlate/steps.py). The other syncs of a step (HF
 * serve: eight of nine, each after an input copy) end nothing, and where the kernel has
 * uprobe sessions (6.13+) their returns are not probed at all: a return probe costs a
 * second trap and its program (~1.3 us and ~0.9 us a sync measured on the development
 * VM and an H200 host). Such a sync is only counted, at its entry, in the burst that
 * goes on; its wait is not timed. A thread is known to sync on its results once a sync
 * has returned with a device-to-host copy in its burst (`result_syncers`); until then,
 * as for a thread that never does, every sync is timed and ends its burst.
 *
 * Under --gpu-sample the syncs can go off with the launch probes (SYNC_GATE in
 * tracer/events/gpu.py): then the device-to-host copy flushes its burst (on_copy), and
 * the step ends there, just before the sync whose wait nothing times now.
 */

struct sync_args {
    u64 ts;
    u64 sp; /* stack pointer at entry: the return address's slot (sessions) */
    u32 api;
    u32 pad;
};
BPF_HASH(sync_inflight, u64, struct sync_args, 16384);
/* threads whose syncs bring results back (tid -> 1): deleted when the thread exits */
BPF_HASH(result_syncers, u32, u8, 16384);

static __always_inline int sync_begin(u64 id, u32 api, u64 sp)
{
    struct sync_args a = {.ts = bpf_ktime_get_ns(), .sp = sp, .api = api};
    if (sync_inflight.update(&id, &a) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

static __always_inline int sync_enter(u32 api)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    if (sync_gate_closed()) {
        /* switched off with the launches: not counted from the gate's closing to the
         * detach (a sync already in flight is still timed at its return). A sync this
         * thread began before is over: one whose return probe came out while it waited
         * left its entry, which the return probe attached again before the gate opens
         * must not take for this sync's. */
        sync_inflight.delete(&id);
        count(TT_CNT_GATED_CALLS);
        return 0;
    }
    return sync_begin(id, api, 0);
}

int tt_sync_stream(struct pt_regs *ctx) { return sync_enter(TT_SYNC_STREAM); }
int tt_sync_event(struct pt_regs *ctx) { return sync_enter(TT_SYNC_EVENT); }
int tt_sync_ctx(struct pt_regs *ctx) { return sync_enter(TT_SYNC_CTX); }

static __always_inline int sync_end(u64 id, struct sync_args *a)
{
    u64 now = bpf_ktime_get_ns();
    u64 start = a->ts;
    u32 api = a->api;
    sync_inflight.delete(&id);
    /* a sync with no launches before it still ends a (then empty) burst: its wait
     * is GPU time the thread spent blocked */
    struct tt_kburst *b = burst_of(id, start);
    if (!b)
        return 0;
    b->sync_calls++;
    b->sync_wait_ns += now - start;
    b->sync_api = api;
    b->last_ts = now;
    u32 tid = (u32)id;
    if (b->copy_calls[TT_COPY_D2H]) {
        u8 one = 1;
        result_syncers.update(&tid, &one);
    }
    if (now - b->first_ts >= config_get(TT_CFG_BURST_MIN_NS, 0))
        flush(tid, b, TT_BURST_SYNC);
    return 0;
}

int tt_sync_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct sync_args *a = sync_inflight.lookup(&id);
    if (!a)
        return 0;
    return sync_end(id, a);
}

/*
 * One program for a sync's entry and its return (an uprobe session link): returning 1
 * at the entry leaves the return unprobed. The return is told from the entry by the
 * stack pointer: the entry's, plus the return address the `ret` popped (x86-64 only:
 * elsewhere tracer/probes/uprobes.py attaches an entry and a return probe instead).
 */
static __always_inline int sync_session(struct pt_regs *ctx, u32 api)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx);
    struct sync_args *a = sync_inflight.lookup(&id);
    if (a && a->sp + 8 == sp)
        return sync_end(id, a);
    if (!is_traced(id >> 32))
        return 1;
    if (sync_gate_closed()) {
        if (a)
            sync_inflight.delete(&id); /* a return that never came (see sync_enter) */
        count(TT_CNT_GATED_CALLS);
        return 1;
    }
    u32 tid = (u32)id;
    struct tt_kburst *b = bursts.lookup(&tid);
    if ((b && b->copy_calls[TT_COPY_D2H]) || !result_syncers.lookup(&tid))
        return sync_begin(id, api, sp); /* it may end a step: timed at its return */
    /* inside a step: counted in the burst that goes on */
    u64 now = bpf_ktime_get_ns();
    if (!b)
        b = burst_of(id, now);
    else if (!b->first_ts)
        b->first_ts = now; /* emptied by the last flush: a burst opens here */
    if (b) {
        b->sync_calls++;
        b->last_ts = now;
    }
    return 1;
}

int tt_sync_stream_session(struct pt_regs *ctx) { return sync_session(ctx, TT_SYNC_STREAM); }
int tt_sync_event_session(struct pt_regs *ctx) { return sync_session(ctx, TT_SYNC_EVENT); }
int tt_sync_ctx_session(struct pt_regs *ctx) { return sync_session(ctx, TT_SYNC_CTX); }

/* cuStreamQuery / cuEventQuery: CUDA_SUCCESS (0) means the work is done, a sync point
 * for a polling thread; CUDA_ERROR_NOT_READY (600) is a poll, counted. */
int tt_query_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct tt_kburst *b = bursts.lookup(&tid);
    if (!b || !b->first_ts)
        return 0; /* nothing launched since the last flush: a bare poll */
    if (PT_REGS_RC(ctx) == 0) {
        u64 now = bpf_ktime_get_ns();
        b->last_ts = now;
        if (now - b->first_ts >= config_get(TT_CFG_BURST_MIN_NS, 0))
            flush(tid, b, TT_BURST_QUERY);
    } else {
        b->query_polls++;
    }
    return 0;
}

/* ---- kernel names ---------------------------------------------------------------- */

struct name_args {
    u64 out;   /* where the driver writes the handle */
    u64 name;  /* const char *, or the CUkernel for cuKernelGetFunction */
    u32 source;
    u32 pad;
};
BPF_HASH(name_inflight, u64, struct name_args, 4096);
BPF_PERCPU_ARRAY(name_scratch, struct tt_kname, 1);

struct alias_key {
    u32 pid;
    u32 pad;
    u64 handle;
    u64 alias_of;
};
/* cuKernelGetFunction aliases already sent. Some libraries call it before every launch
 * (an HF serve capture: 10,640 alias records for 5 handles); one record per alias is
 * all user space needs. LRU: bounded, and a reused handle is sent again once evicted. */
BPF_TABLE("lru_hash", struct alias_key, u8, alias_sent, 16384);
/* name look-ups seen: user space detaches these probes after a stretch of look-ups that
 * sent nothing new (tracer/probes/lookups.py), and must tell that from a process that
 * looks nothing up (idle) */
BPF_PERCPU_ARRAY(name_calls, u64, 1);

static __always_inline int name_enter(u64 out, u64 name, u32 source)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    u32 zero = 0;
    u64 *calls = name_calls.lookup(&zero);
    if (calls)
        (*calls)++;
    struct name_args a = {.out = out, .name = name, .source = source};
    if (name_inflight.update(&id, &a) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

/* cuModuleGetFunction(CUfunction *out, CUmodule, const char *name) */
int tt_module_get_function(struct pt_regs *ctx)
{
    return name_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM3(ctx), TT_NAME_MODULE_GET_FUNCTION);
}
/* cuLibraryGetKernel(CUkernel *out, CUlibrary, const char *name) */
int tt_library_get_kernel(struct pt_regs *ctx)
{
    return name_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM3(ctx), TT_NAME_LIBRARY_GET_KERNEL);
}
/* cuKernelGetFunction(CUfunction *out, CUkernel kernel) */
int tt_kernel_get_function(struct pt_regs *ctx)
{
    return name_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), TT_NAME_KERNEL_GET_FUNCTION);
}

int tt_name_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct name_args *a = name_inflight.lookup(&id);
    if (!a)
        return 0;
    struct name_args args = *a;
    name_inflight.delete(&id);
    if (PT_REGS_RC(ctx) != 0)
        return 0; /* the driver failed: no handle was written */
    u32 zero = 0;
    struct tt_kname *n = name_scratch.lookup(&zero);
    if (!n)
        return 0;
    n->kind = TT_KIND_KNAME;
    n->pid = id >> 32;
    n->tid = (u32)id;
    n->source = args.source;
    n->ts = bpf_ktime_get_ns();
    n->handle = 0;
    n->alias_of = 0;
    n->name[0] = 0;
    bpf_probe_read_user(&n->handle, sizeof(n->handle), (void *)args.out);
    /* named live: its host stub need never be sent */
    stub_mark_named(n->pid, n->handle);
    if (args.source == TT_NAME_KERNEL_GET_FUNCTION) {
        struct alias_key k = {.pid = n->pid, .handle = n->handle, .alias_of = args.name};
        u8 one = 1;
        if (alias_sent.lookup(&k))
            return 0;
        alias_sent.update(&k, &one);
        n->alias_of = args.name;
    } else if (bpf_probe_read_user_str(n->name, sizeof(n->name), (void *)args.name) < 0)
        count(TT_CNT_NAMES_FULL);
    submit(n, sizeof(*n), TT_CNT_LOST_GPU);
    return 0;
}

/* ---- device memory --------------------------------------------------------------- */

struct alloc_args {
    u64 out;
    u64 bytes;
};
BPF_HASH(alloc_inflight, u64, struct alloc_args, 4096);
struct alloc_key {
    u32 tgid;
    u32 pad;
    u64 ptr;
};
BPF_HASH(allocations, struct alloc_key, u64, 262144);
BPF_HASH(live_bytes, u32, u64, 16384); /* tgid -> device bytes held */

/* cuMemAlloc_v2 / cuMemAllocAsync / cuMemAllocFromPoolAsync / cuMemAllocManaged:
 * (CUdeviceptr *out, size_t bytes, ...) */
int tt_alloc(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    struct alloc_args a = {.out = PT_REGS_PARM1(ctx), .bytes = PT_REGS_PARM2(ctx)};
    if (alloc_inflight.update(&id, &a) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

static __always_inline void send_mem(u64 id, u16 op, u64 ptr, u64 bytes, u64 live, u16 known)
{
    struct tt_mem m = {};
    m.kind = TT_KIND_MEM;
    m.pid = id >> 32;
    m.tid = (u32)id;
    m.op = op;
    m.known = known;
    m.ts = bpf_ktime_get_ns();
    m.ptr = ptr;
    m.bytes = bytes;
    m.live = live;
    submit(&m, sizeof(m), TT_CNT_LOST_GPU);
}

int tt_alloc_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct alloc_args *a = alloc_inflight.lookup(&id);
    if (!a)
        return 0;
    struct alloc_args args = *a;
    alloc_inflight.delete(&id);
    if (PT_REGS_RC(ctx) != 0)
        return 0;
    struct alloc_key k = {.tgid = id >> 32};
    bpf_probe_read_user(&k.ptr, sizeof(k.ptr), (void *)args.out);
    allocations.update(&k, &args.bytes);
    u64 zero = 0;
    u64 *live = live_bytes.lookup_or_try_init(&k.tgid, &zero);
    u64 now_live = args.bytes;
    if (live)
        now_live = __sync_fetch_and_add(live, args.bytes) + args.bytes;
    send_mem(id, TT_MEM_ALLOC, k.ptr, args.bytes, now_live, 1);
    return 0;
}

/* cuMemFree_v2(ptr) / cuMemFreeAsync(ptr, stream) */
int tt_free(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    struct alloc_key k = {.tgid = id >> 32, .ptr = PT_REGS_PARM1(ctx)};
    u64 *size = allocations.lookup(&k);
    u64 bytes = size ? *size : 0;
    u64 now_live = 0;
    u64 *live = live_bytes.lookup(&k.tgid);
    if (size) {
        allocations.delete(&k);
        if (live)
            now_live = __sync_fetch_and_add(live, -bytes) - bytes;
    } else if (live) {
        now_live = *live;
    }
    send_mem(id, TT_MEM_FREE, k.ptr, bytes, now_live, size != NULL);
    return 0;
}

/* Called from process.c when a traced thread exits: its last burst is not lost. */
static __always_inline void gpu_thread_exit(u32 tid)
{
    struct tt_kburst *b = bursts.lookup(&tid);
    if (b && b->first_ts)
        flush(tid, b, TT_BURST_EXIT);
    bursts.delete(&tid);
    stub_pending.delete(&tid);
    result_syncers.delete(&tid);
#ifdef TT_STACKS
    stacks_thread_exit(tid);
#endif
}
#define TT_HAVE_GPU_THREAD_EXIT 1
