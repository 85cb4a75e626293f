/*
 * Process lifecycle of traced processes: children of a traced process are traced from
 * their first instruction (pre-fork servers, engine subprocesses); exec'ing a program
 * named in traced_comms starts tracing (--comm); exit ends a process's requests.
 */

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    u32 *flags = traced.lookup(&parent);
    if (!flags)
        return 0;
    count_traced_runs(1);
    u32 child = args->child_pid;
    u32 val = *flags;
    /* Threads fire this too; their tid key is harmless and is removed at their exit. */
    traced.update(&child, &val);

    struct tt_proc p = {};
    p.kind = TT_KIND_PROC;
    p.op = TT_PROC_FORK;
    p.pid = child;
    p.ppid = parent;
    p.tid = (u32)bpf_get_current_pid_tgid();
    p.ts = bpf_ktime_get_ns();
    bpf_get_current_comm(&p.comm, sizeof(p.comm));
    submit(&p, sizeof(p), TT_CNT_LOST_PROC);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    struct tt_proc p = {};
    bpf_get_current_comm(&p.comm, sizeof(p.comm));
    if (!is_traced(tgid)) {
        struct comm_key key = {};
        __builtin_memcpy(key.comm, p.comm, sizeof(key.comm));
        if (!traced_comms.lookup(&key))
            return 0;
        u32 one = 1;
        traced.update(&tgid, &one);
    }
    count_traced_runs(1);
    p.kind = TT_KIND_PROC;
    p.op = TT_PROC_EXEC;
    p.pid = tgid;
    p.tid = (u32)id;
    p.ts = bpf_ktime_get_ns();
    submit(&p, sizeof(p), TT_CNT_LOST_PROC);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    int mine = is_traced(tgid);
    if (mine)
        count_traced_runs(1); /* every thread's exit: the overhead meter's traced runs */
#ifdef TT_HAVE_GPU_THREAD_EXIT
    if (mine)
        gpu_thread_exit(tid); /* bpf/cuda.c: the thread's last burst */
#endif
#ifdef TT_HAVE_GROUP_DEAD
    /* The whole thread group is gone only when the last thread exits. */
    if (!args->group_dead) {
        if (tid != tgid)
            traced.delete(&tid);
        return 0;
    }
#else
    if (tid != tgid) {
        traced.delete(&tid);
        return 0;
    }
#endif
    if (!mine)
        return 0;
    traced.delete(&tgid);
    if (tid != tgid)
        traced.delete(&tid);

    struct tt_proc p = {};
    p.kind = TT_KIND_PROC;
    p.op = TT_PROC_EXIT;
    p.pid = tgid;
    p.tid = tid;
    p.ts = bpf_ktime_get_ns();
    bpf_get_current_comm(&p.comm, sizeof(p.comm));
    submit(&p, sizeof(p), TT_CNT_LOST_PROC);
    return 0;
}
