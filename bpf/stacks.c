/*
 * Launch-site stacks: which code made a thread launch a kernel, a CUDA graph, a copy or
 * an NCCL call. Compiled in (-DTT_STACKS) before cuda.c and nccl.c, whose probes call
 * stacks_call() for every GPU call they count and stacks_flush() just before a burst
 * is sent.
 *
 * Sampled: a thread's call is looked at when its countdown runs out (every
 * stk_config[STK_CFG_EVERY] calls on average, jittered so that a step that repeats the
 * same sequence of launches is not always sampled at the same place; or exactly every
 * Nth with STK_CFG_JITTER 0) and always the first time a process makes a call of a
 * (kind, handle) it never made before, so every kernel gets at least one stack.
 *
 * A sample walks the CPython frames of the thread (layout per process in py_procs,
 * written by tracer/probes/pystacks.py) and takes the return address on the stack;
 * together with the call's kind and handle they make a stack id. Identical stacks are
 * counted per thread in its tt_kstacks (16 slots), which goes out right before the
 * thread's next burst (so a request gets a burst's stacks exactly as it gets its
 * launches), or earlier when a 17th distinct stack comes. Never a record per launch.
 * The first sample of a stack id (per process) also sends a STACKDEF with the Python
 * frames' code objects and a slice of the user stack, which user space unwinds once
 * with the libraries' .eh_frame (frame pointers are mostly absent in CUDA and PyTorch
 * libraries) and symbolises.
 */

#define STK_CFG_EVERY 0  /* mean calls between samples of a thread (0 or 1: every call) */
#define STK_CFG_JITTER 1 /* 1: random gaps of mean EVERY; 0: exactly every EVERY-th */
#define STK_CFG_SLICE 2  /* bytes of user stack to send with a new stack (<= STACK_SLICE) */
#define STK_CFG_ON 3     /* 0: sampling paused (a GPU call pays one array read) */
#define STK_CFG_DEF_BUDGET 4 /* STACKDEFs sent per process at most (0: no limit) */
#define STK_CFG_N 5
BPF_ARRAY(stk_config, u64, STK_CFG_N); /* written by user space before attaching */

static __always_inline u64 stk_cfg(u32 idx)
{
    u64 *v = stk_config.lookup(&idx);
    return v ? *v : 0;
}

/* what the stack sampler did and what it could not do, per CPU (read by user space) */
#define STK_CNT_SAMPLES 0     /* calls sampled */
#define STK_CNT_NEW_SITE 1    /* ...of which because their (kind, handle) was new */
#define STK_CNT_DEFS 2        /* STACKDEF records sent */
#define STK_CNT_DEFS_LOST 3   /* STACKDEF records the ring buffer had no room for */
#define STK_CNT_NO_THREAD 4   /* Python process, but no thread state is this thread's */
#define STK_CNT_PY_CUT 5      /* more Python frames than PY_FRAMES_N */
#define STK_CNT_EARLY 6       /* a thread's slots sent before its burst (17th stack) */
#define STK_CNT_FULL 7        /* a map was full: that call was not sampled */
#define STK_CNT_OVER_BUDGET 8 /* samples of a new stack whose process's STACKDEF budget was spent */
#define STK_CNT_N 9
BPF_PERCPU_ARRAY(stk_counters, u64, STK_CNT_N);

static __always_inline void stk_count(u32 which)
{
    u64 *c = stk_counters.lookup(&which);
    if (c)
        (*c)++;
}

/* Where an interpreter keeps its threads and frames; one per traced Python process,
 * offsets from CPython's headers for 3.10-3.12 and from _Py_DebugOffsets for 3.13+
 * (tracer/probes/pystacks.py). A process without an entry gets no Python frames. */
struct py_layout {
    u64 runtime;       /* &_PyRuntime in the process */
    u16 interp_head;   /* offsetof(_PyRuntimeState, interpreters.head) */
    u16 interp_next;   /* offsetof(PyInterpreterState, next) */
    u16 threads_head;  /* offsetof(PyInterpreterState, threads.head) */
    u16 ts_next;       /* offsetof(PyThreadState, next) */
    u16 ts_tid;        /* native_thread_id (3.11+), thread_id (3.10: a pthread_t) */
    u16 ts_frame;      /* frame (3.10), cframe (3.11, 3.12), current_frame (3.13+) */
    s16 cframe_frame;  /* offsetof(_PyCFrame, current_frame); -1: ts_frame is the frame */
    u16 fr_prev;       /* f_back (3.10), previous */
    u16 fr_code;       /* f_code, f_executable (3.13+) */
    u16 fr_instr;      /* f_lasti (3.10), prev_instr, instr_ptr (3.13+) */
    s16 fr_owner;      /* owner; -1: none (3.10) */
    u16 fr_size;       /* bytes read per frame: covers the fields above (<= 128) */
    u8 tid_is_pthread; /* 3.10: match thread_id to the thread's stack, not its tid */
    u8 instr_is_int;   /* 3.10: f_lasti is an int index */
    u8 cstack_owner;   /* owner value of C-stack shim frames to skip; 0xff: none */
    u8 pad[3];
    u64 stack_max;     /* 3.10: a thread's default stack size (a descriptor farther above
                        * the stack pointer is another thread's) */
};
BPF_HASH(py_procs, u32, struct py_layout, 1024);

/* tid -> its PyThreadState, found by walking the interpreter's thread list here (the
 * newest STK_PY_THREADS) or written by user space from its own walk of all of them
 * (tracer/probes/stacks.py: a main thread behind more than STK_PY_THREADS newer
 * states), and checked at every use (a freed thread state can be reused by another
 * thread). 3.10 keeps no thread id to check: user space writes only the main thread's
 * (key: the pid), the oldest state. */
BPF_TABLE("lru_hash", u32, u64, stk_tstate, 16384);

/* each thread's stack counts since its last burst; calls/countdown persist */
BPF_HASH(stk_threads, u32, struct tt_kstacks, 16384);
BPF_PERCPU_ARRAY(stk_zero, struct tt_kstacks, 1); /* never written */
/* per thread: calls left until its next sample (kept apart: the record's fields go out) */
BPF_HASH(stk_countdown, u32, u32, 16384);

struct stk_site_key {
    u32 pid;
    u16 what;
    u16 pad;
    u64 handle;
};
/* (process, kind, handle) seen: a call of one not seen before is always sampled */
BPF_TABLE("lru_hash", struct stk_site_key, u8, stk_sites, 65536);

struct stk_known_key {
    u32 pid;
    u32 pad;
    u64 stack_id;
};
/* stacks whose STACKDEF was sent (evicted: sent again, user space keeps the first) */
BPF_TABLE("lru_hash", struct stk_known_key, u8, stk_known, 65536);

/* STACKDEFs sent per process: a process making ever new stacks (a new kernel handle is
 * a new stack) gets at most STK_CFG_DEF_BUDGET of them (user space deletes its entry at
 * exit); its further new stacks are counted, never defined */
BPF_HASH(stk_defs_sent, u32, u32, 16384);

/* a stack being taken: its STACKDEF, sent only if the stack is new; plus a frame's bytes */
struct stk_scratch {
    struct tt_stackdef def;
    u8 frame[136];
};
BPF_PERCPU_ARRAY(stk_scratch, struct stk_scratch, 1);

#define STK_PY_THREADS 128 /* thread states looked at per interpreter */
#define STK_PY_INTERPS 2
#define STK_FNV_PRIME 1099511628211ULL

static __always_inline u64 stk_mix(u64 h, u64 v)
{
    h ^= v;
    h *= STK_FNV_PRIME;
    h ^= h >> 29;
    return h;
}

static __always_inline u64 stk_read_u64(u64 addr)
{
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* The thread state of thread tid of process pid (layout L), or 0. */
static __always_inline u64 py_tstate(struct py_layout *L, u32 pid, u32 tid, u64 sp)
{
    u64 *cached = stk_tstate.lookup(&tid);
    if (!L->tid_is_pthread) {
        if (cached && *cached && stk_read_u64(*cached + L->ts_tid) == tid)
            return *cached;
    } else if (cached && *cached && tid == pid) {
        return *cached; /* 3.10's main thread, from user space */
    }
    u64 interp = stk_read_u64(L->runtime + L->interp_head);
    u64 best = 0, best_gap = ~0ULL, oldest = 0;
    for (int k = 0; k < STK_PY_INTERPS; k++) {
        if (!interp)
            break;
        u64 ts = stk_read_u64(interp + L->threads_head);
        for (int i = 0; i < STK_PY_THREADS; i++) {
            if (!ts)
                break;
            u64 id = stk_read_u64(ts + L->ts_tid);
            if (!L->tid_is_pthread) {
                if (id == tid) {
                    stk_tstate.update(&tid, &ts);
                    return ts;
                }
            } else if (id > sp && id - sp < best_gap) {
                /* 3.10 keeps only pthread_self(): glibc puts a thread's descriptor at
                 * the top of its stack mapping, so the nearest one above the stack
                 * pointer, within a stack's size, is this thread's; the main thread's
                 * is elsewhere (the oldest state) */
                best = ts;
                best_gap = id - sp;
            }
            oldest = ts;
            ts = stk_read_u64(ts + L->ts_next);
        }
        interp = stk_read_u64(interp + L->interp_next);
    }
    /* a thread with no state of its own must not get another's: a descriptor farther
     * than a stack's size is another thread's (thread stacks are adjacent mappings),
     * and only the main thread takes the oldest state */
    if (L->tid_is_pthread)
        return best_gap < L->stack_max ? best : (tid == pid ? oldest : 0);
    return 0;
}

/* Read the thread's Python frames into d (innermost first); their hash. */
static __always_inline u64 py_frames(struct stk_scratch *s, struct py_layout *L, u32 pid,
                                     u32 tid, u64 sp)
{
    struct tt_stackdef *d = &s->def;
    u64 ts = py_tstate(L, pid, tid, sp);
    if (!ts) {
        d->flags |= TT_STK_PY_NO_THREAD;
        stk_count(STK_CNT_NO_THREAD);
        return 0;
    }
    d->flags |= TT_STK_PY;
    u64 fr = stk_read_u64(ts + L->ts_frame);
    if (L->cframe_frame >= 0 && fr)
        fr = stk_read_u64(fr + (u16)L->cframe_frame);
    u32 size = L->fr_size;
    if (size > 128)
        size = 128;
    u64 h = 0xcbf29ce484222325ULL;
    /* Every frame goes to slot i (a skipped shim frame as code 0): no count that
     * depends on a branch, so the verifier's states converge at each iteration
     * instead of doubling (it refused the loop otherwise). */
    for (int i = 0; i < TT_PY_FRAMES_N; i++) {
        if (!fr)
            break;
        if (bpf_probe_read_user(s->frame, size, (void *)fr) != 0) {
            fr = 0;
            break;
        }
        u64 code = *(u64 *)(s->frame + (L->fr_code & 0x78)) & ~3ULL; /* 3.14: tagged */
        u64 prev = *(u64 *)(s->frame + (L->fr_prev & 0x78));
        u64 instr = L->instr_is_int ? (u64)(s64) * (s32 *)(s->frame + (L->fr_instr & 0x7c))
                                    : *(u64 *)(s->frame + (L->fr_instr & 0x78));
        if (L->fr_owner >= 0 && s->frame[L->fr_owner & 0x7f] == L->cstack_owner)
            code = 0; /* a C-stack shim (3.12+): not a Python function */
        d->py_code[i] = code;
        d->py_instr[i] = instr;
        h = stk_mix(stk_mix(h, code), instr);
        d->py_depth = i + 1;
        fr = prev;
    }
    if (fr) {
        d->flags |= TT_STK_PY_TRUNCATED;
        stk_count(STK_CNT_PY_CUT);
    }
    return h;
}

/* Send the STACKDEF being built, with the first bytes of the user stack; 0 if sent. */
static __always_inline int stk_send_def(struct tt_stackdef *d, u64 sp)
{
    u32 want = stk_cfg(STK_CFG_SLICE);
    u32 got = 0;
    /* 1 KiB at a time: a read running past the top of the stack fails whole */
    for (int i = 0; i < TT_STACK_SLICE / 1024; i++) {
        if (got + 1024 > want)
            break;
        if (bpf_probe_read_user(d->slice + i * 1024, 1024, (void *)(sp + i * 1024)) != 0) {
            d->flags |= TT_STK_SLICE_CUT;
            break;
        }
        got += 1024;
    }
    d->slice_len = got;
    u32 size = TT_TT_STACKDEF_HDR + got;
    if (size > sizeof(*d))
        size = sizeof(*d);
    if (ring_out(d, size, BPF_RB_FORCE_WAKEUP) != 0) {
        stk_count(STK_CNT_DEFS_LOST);
        return -1;
    }
    stk_count(STK_CNT_DEFS);
    return 0;
}

/* A thread's stack counts go out (before its burst, or when its slots are full). */
static __always_inline void stk_submit(struct tt_kstacks *t)
{
    if (!t->n)
        return;
    submit(t, sizeof(*t), TT_CNT_LOST_GPU);
    t->n = 0;
}

static __always_inline void stacks_flush(u32 tid)
{
    struct tt_kstacks *t = stk_threads.lookup(&tid);
    if (t)
        stk_submit(t);
}

static __always_inline void stacks_thread_exit(u32 tid)
{
    stacks_flush(tid);
    stk_threads.delete(&tid);
    stk_countdown.delete(&tid);
    stk_tstate.delete(&tid);
}

/* A GPU call of kind what (TT_STK_*) with handle, made while the thread's burst that
 * began at burst_ts was open: sample it if its turn has come or its site is new. */
static __always_inline void stacks_call(struct pt_regs *ctx, u64 id, u16 what, u64 handle,
                                        u64 burst_ts)
{
    if (!stk_cfg(STK_CFG_ON))
        return;
    u32 pid = id >> 32, tid = (u32)id;
    u64 every = stk_cfg(STK_CFG_EVERY);
    if (every < 1)
        every = 1;
    u32 *left = stk_countdown.lookup(&tid);
    int due = every == 1;
    if (left) {
        if (*left <= 1) {
            due = 1;
            u32 next = every;
            if (stk_cfg(STK_CFG_JITTER) && every > 1)
                next = 1 + bpf_get_prandom_u32() % (2 * every - 1); /* mean: every */
            *left = next;
        } else {
            (*left)--;
        }
    } else {
        u32 first = every - 1; /* with no jitter: calls every, 2 x every, ... */
        if (stk_countdown.update(&tid, &first) != 0)
            stk_count(STK_CNT_FULL);
    }
    /* the first call of a (kind, handle) in the process is always sampled */
    struct stk_site_key k = {.pid = pid, .what = what, .handle = handle};
    if (!stk_sites.lookup(&k)) {
        u8 one = 1;
        stk_sites.update(&k, &one);
        if (!due)
            stk_count(STK_CNT_NEW_SITE);
        due = 1;
    }
    if (!due)
        return;
    stk_count(STK_CNT_SAMPLES);

    u32 zero = 0;
    struct stk_scratch *s = stk_scratch.lookup(&zero);
    if (!s)
        return;
    struct tt_stackdef *d = &s->def;
    u64 sp = PT_REGS_SP(ctx);
    d->kind = TT_KIND_STACKDEF;
    d->pid = pid;
    d->tid = tid;
    d->what = what;
    d->flags = 0;
    d->py_depth = 0;
    d->handle = handle;
    d->ip = PT_REGS_IP(ctx);
    d->sp = sp;
    d->bp = PT_REGS_FP(ctx);
    u64 h = 0;
    struct py_layout *L = py_procs.lookup(&pid);
    if (L)
        h = py_frames(s, L, pid, tid, sp);
    u64 ret = 0;
#if defined(bpf_target_x86) /* at a function's entry the return address is at sp */
    ret = stk_read_u64(sp);
#endif
    u64 sid = stk_mix(stk_mix(stk_mix(stk_mix(h, ret), what), handle), pid);
    sid |= 1; /* never 0: 0 means "no stack" in user space */
    d->stack_id = sid;

    struct stk_known_key kk = {.pid = pid, .stack_id = sid};
    if (!stk_known.lookup(&kk)) {
        u64 budget = stk_cfg(STK_CFG_DEF_BUDGET);
        u32 *sent = stk_defs_sent.lookup(&pid);
        if (budget && sent && *sent >= budget) {
            stk_count(STK_CNT_OVER_BUDGET);
        } else {
            d->ts = bpf_ktime_get_ns();
            u8 one = 1;
            /* marked first (another CPU sampling the same stack meanwhile sends no
             * second copy), unmarked if the ring buffer had no room: sent again at its
             * next sample */
            stk_known.update(&kk, &one);
            if (stk_send_def(d, sp) != 0) {
                stk_known.delete(&kk);
            } else if (sent) {
                __sync_fetch_and_add(sent, 1);
            } else {
                u32 first = 1;
                stk_defs_sent.update(&pid, &first);
            }
        }
    }

    struct tt_kstacks *t = stk_threads.lookup(&tid);
    if (!t) {
        struct tt_kstacks *z = stk_zero.lookup(&zero);
        if (!z || stk_threads.update(&tid, z) != 0) {
            stk_count(STK_CNT_FULL);
            return;
        }
        t = stk_threads.lookup(&tid);
        if (!t)
            return;
        t->kind = TT_KIND_KSTACKS;
        t->pid = pid;
        t->tid = tid;
    }
    t->samples++;
    u32 n = t->n;
#define TT_STK_SLOT(i)                                                           \
    if ((i) < n && t->ids[i] == sid) {                                           \
        t->counts[i]++;                                                          \
        return;                                                                  \
    }
    TT_STK_SLOT(0) TT_STK_SLOT(1) TT_STK_SLOT(2) TT_STK_SLOT(3) TT_STK_SLOT(4)
    TT_STK_SLOT(5) TT_STK_SLOT(6) TT_STK_SLOT(7) TT_STK_SLOT(8) TT_STK_SLOT(9)
    TT_STK_SLOT(10) TT_STK_SLOT(11) TT_STK_SLOT(12) TT_STK_SLOT(13) TT_STK_SLOT(14)
    TT_STK_SLOT(15)
#undef TT_STK_SLOT
    _Static_assert(TT_STACK_SLOTS_N == 16, "one TT_STK_SLOT per slot");
    if (n >= TT_STACK_SLOTS_N) {
        stk_count(STK_CNT_EARLY);
        stk_submit(t);
        n = 0;
    }
    if (n == 0)
        t->burst_ts = burst_ts;
    u32 slot = n & (TT_STACK_SLOTS_N - 1);
    t->ids[slot] = sid;
    t->handles[slot] = handle;
    t->counts[slot] = 1;
    t->whats[slot] = what;
    t->n = slot + 1;
}
#define TT_HAVE_STACKS 1
