/*
 * Socket syscalls of traced processes: connection lifecycle (accept, connect, close)
 * and the bytes of every data syscall that Python and native servers use (read, write,
 * readv, writev, recvfrom, sendto, recvmsg, sendmsg).
 *
 * Only file descriptors known to be sockets are captured: accept/connect put them in
 * `conns`, and Python adds the sockets a process already had at attach. A traced
 * thread's call is held at its entry whatever the fd (io_call: a slot of its own), and
 * its exit looks the fd up in `conns` once: a plain file's read costs that look-up and
 * nothing else, a socket's call no second one at its entry.
 *
 * Payload: entry saves the buffer (or iovec array) pointer, exit copies up to the
 * capture limit in TT_CHUNK pieces, each its own DATA record, the last one flagged.
 * Each direction of a connection keeps a byte counter, so Python can tell exactly
 * where a lost or truncated record left a gap in the stream.
 *
 * Token writes of a streamed response are staged into RUN records (see "runs" below).
 */

#define SHAPE_BUF 0 /* one buffer */
#define SHAPE_IOV 1 /* iovec array (readv/writev, and msghdr resolved at entry) */
/* a plain read's size, kept in io_args.iovcnt (unused for one buffer) */
#define BUF_SIZE(n) ((n) > 0xffffffffUL ? 0xffffffffU : (u32)(n))

/* A TCP socket's 4-tuple as the TCP tracepoints give it: bpf/netwait.c's key. */
struct nw_key {
    u8 laddr[16]; /* IPv6, or IPv4-mapped (::ffff:a.b.c.d) as the tracepoints store it */
    u8 raddr[16];
    u16 lport;    /* host byte order */
    u16 rport;
};

struct conn_state {
    u64 conn_id;
    u64 bytes_in;  /* stream offsets, advanced atomically at each syscall exit */
    u64 bytes_out;
    u32 role;
    u32 peer_known; /* 0 until the peer address has been sent to user space */
    u32 staged;     /* 1 while run_stages holds token writes of it not yet sent */
    u32 nw_known;   /* netwait: 1 once `nw` is learnt, at the socket's first read */
    u32 tls_plain;  /* 1 once its first bytes were plaintext HTTP (is_plain_http) */
    u32 pad;
    /* netwait: the socket's 4-tuple, its key in nw_socks. Kept here, not in a map of
     * its own, so a syscall's exit finds it with the connection: one look-up a token
     * write fewer, where the server's own work has left the maps out of the cache */
    struct nw_key nw;
};
/* (tgid << 32 | fd) -> connection */
BPF_HASH(conns, u64, struct conn_state, 65536);

struct io_args {
    u64 buf;
    u64 ts_enter;
    u64 conn_id; /* set at the exit, from the connection it finds for the fd */
    s32 fd;
    u32 iovcnt;  /* iovec count; a plain read's buffer size (netwait: short read) */
    u16 syscall;
    u8 shape;
    u8 direction;
    u32 epoch;   /* TT_CFG_IO_EPOCH at entry: 0 once the exit took it */
};

/*
 * The data syscall in flight on each thread, from its entry to its exit.
 *
 * TT_TASK_STORAGE (the loader's choice where the kernel has task-local storage for
 * tracing programs, 5.12+, and BTF): a slot in the thread's own task_struct storage.
 * A token's write and its read then touch no shared hash table for the call: a hash
 * cost an insert at entry and a look-up and a delete at exit, each a bucket and an
 * element that the server's own work had pushed out of the cache. A slot is never
 * deleted (the kernel frees it with the thread); `epoch` says whether it holds a call:
 * 0 once its exit took it, and a call entered before a pause (its exit unseen, or seen
 * after the resume) carries an older epoch than the one the resume set, so it is not
 * taken for a live one, as the hash's emptying at the resume made sure before.
 *
 * Otherwise a hash keyed by pid_tgid, emptied at the resume.
 */
#ifdef TT_TASK_STORAGE
BPF_TASK_STORAGE(io_inflight, struct io_args);
#else
BPF_HASH(io_inflight, u64, struct io_args, 16384);
#endif

static __always_inline u32 io_epoch(void)
{
    return (u32)config_get(TT_CFG_IO_EPOCH, 1);
}

#ifndef TT_TASK_STORAGE
BPF_PERCPU_ARRAY(io_scratch, struct io_args, 1); /* an entry's call, copied into the hash */
#endif

/*
 * Where a traced thread's entry writes its call, or NULL for a thread not traced.
 * With task storage a thread that has a slot is traced without asking `traced`: it
 * took the slot while traced, and a process stays traced until it exits (nothing
 * takes a live process out of `traced`; its threads die with it, their slots too), so
 * only a thread's first socket syscall looks its process up.
 */
static __always_inline struct io_args *io_call_slot(u64 id)
{
#ifdef TT_TASK_STORAGE
    struct task_struct *task = bpf_get_current_task_btf();
    struct io_args *a = io_inflight.task_storage_get(task, 0, 0);
    if (!a) {
        if (!is_traced(id >> 32))
            return NULL;
        a = io_inflight.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
        if (!a)
            count(TT_CNT_INFLIGHT_FULL);
    }
    count_traced_runs(2);
    return a;
#else
    if (!is_traced(id >> 32))
        return NULL;
    count_traced_runs(2);
    u32 zero = 0;
    return io_scratch.lookup(&zero);
#endif
}

/* `a` (from io_call_slot, filled) is the thread's call in flight from now. */
static __always_inline void io_call_hold(u64 id, struct io_args *a)
{
    a->epoch = io_epoch();
#ifndef TT_TASK_STORAGE
    if (io_inflight.update(&id, a) != 0)
        count(TT_CNT_INFLIGHT_FULL);
#endif
}

/* The thread's call in flight, or NULL; `sys` (TT_SYS_*, 0: any): the syscall whose
 * exit asks, so that an entry whose own exit went unseen (its probe not yet attached
 * at an attach or resume) is never taken at the exit of another. */
static __always_inline struct io_args *io_call(u64 id, u16 sys)
{
#ifdef TT_TASK_STORAGE
    struct io_args *a = io_inflight.task_storage_get(bpf_get_current_task_btf(), 0, 0);
#else
    struct io_args *a = io_inflight.lookup(&id);
#endif
    if (!a || a->epoch != io_epoch() || (sys && a->syscall != sys))
        return NULL;
    return a;
}

/* The thread's call in flight is over. */
static __always_inline void io_call_done(u64 id, struct io_args *a)
{
#ifdef TT_TASK_STORAGE
    a->epoch = 0;
#else
    io_inflight.delete(&id);
#endif
}

#ifdef TT_TLS
/* bpf/tls.c (appended after this file): which socket an SSL object belongs to, and
 * ciphertext of sockets whose plaintext the TLS probes follow */
static __always_inline void tls_io_enter(u64 id, s32 fd, u64 conn_id);
static __always_inline int tls_io_exit(u64 id, struct io_args *a, long ret);
#endif

#ifdef TT_NETWAIT
/* bpf/netwait.c (appended after this file): when the kernel held the bytes */
static __always_inline void nw_rcv_space(struct conn_state *st, u16 lport, u16 rport,
                                         const u8 *laddr, const u8 *raddr);
static __always_inline void nw_io_exit(struct io_args *a, struct tt_data *d, long ret,
                                       struct conn_state *st);
#endif

struct accept_args {
    u64 addr;
    s32 listen_fd;
    u32 pad;
};
BPF_HASH(accept_inflight, u64, struct accept_args, 4096);

struct connect_args {
    u64 addr;
    s32 fd;
    u32 pad;
};
BPF_HASH(connect_inflight, u64, struct connect_args, 4096);

BPF_PERCPU_ARRAY(data_scratch, struct tt_data, 1);

/* sockaddr_in6 is the largest of the two inet forms; both start with family, port. */
struct sockaddr_any {
    u16 family;
    u16 port_be;
    u32 v4_or_flowinfo;
    u8 v6[16];
    u32 scope;
};

static __always_inline u64 conn_key(u32 tgid, s32 fd)
{
    return ((u64)tgid << 32) | (u32)fd;
}

static __always_inline void fill_peer(struct tt_conn *c, u64 uaddr)
{
    struct sockaddr_any sa = {};
    if (!uaddr || bpf_probe_read_user(&sa, sizeof(sa), (void *)uaddr) != 0)
        return;
    c->family = sa.family;
    c->port = bpf_ntohs(sa.port_be);
    if (sa.family == 2 /* AF_INET */)
        __builtin_memcpy(c->addr, &sa.v4_or_flowinfo, 4);
    else if (sa.family == 10 /* AF_INET6 */)
        __builtin_memcpy(c->addr, sa.v6, 16);
}

static __always_inline void open_conn(void *ctx, s32 fd, u16 op, u16 role, s32 ret,
                                      s32 listen_fd, u64 uaddr)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u64 key = conn_key(tgid, fd);
    struct conn_state st = {};
    st.conn_id = bpf_ktime_get_ns();
    st.role = role;

    struct tt_conn c = {};
    c.kind = TT_KIND_CONN;
    c.pid = tgid;
    c.tid = (u32)id;
    c.fd = fd;
    c.ts = st.conn_id;
    c.conn_id = st.conn_id;
    c.ret = ret;
    c.listen_fd = listen_fd;
    c.op = op;
    c.role = role;
    fill_peer(&c, uaddr);
    st.peer_known = c.family != 0;
    if (conns.update(&key, &st) != 0)
        count(TT_CNT_CONNS_FULL);
    submit(&c, sizeof(c), TT_CNT_LOST_CONN);
}

/* ---- accept / accept4 ---------------------------------------------------------- */

static __always_inline int accept_enter(s32 listen_fd, u64 uaddr)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    count_traced_runs(2);
    struct accept_args a = {.addr = uaddr, .listen_fd = listen_fd};
    if (accept_inflight.update(&id, &a) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

static __always_inline int accept_exit(void *ctx, long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    struct accept_args *a = accept_inflight.lookup(&id);
    if (!a)
        return 0;
    if (ret >= 0)
        open_conn(ctx, ret, TT_CONN_ACCEPT, TT_ROLE_SERVER, 0, a->listen_fd, a->addr);
    accept_inflight.delete(&id);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_accept)
{
    return accept_enter(args->fd, (u64)args->upeer_sockaddr);
}
TRACEPOINT_PROBE(syscalls, sys_exit_accept) { return accept_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_accept4)
{
    return accept_enter(args->fd, (u64)args->upeer_sockaddr);
}
TRACEPOINT_PROBE(syscalls, sys_exit_accept4) { return accept_exit(args, args->ret); }

/* ---- connect ------------------------------------------------------------------- */

TRACEPOINT_PROBE(syscalls, sys_enter_connect)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_traced(id >> 32))
        return 0;
    count_traced_runs(2);
    struct connect_args a = {.addr = (u64)args->uservaddr, .fd = args->fd};
    if (connect_inflight.update(&id, &a) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_connect)
{
    u64 id = bpf_get_current_pid_tgid();
    struct connect_args *a = connect_inflight.lookup(&id);
    if (!a)
        return 0;
    /* Non-blocking sockets answer -EINPROGRESS and connect in the background. */
    if (args->ret == 0 || args->ret == -115)
        open_conn(args, a->fd, TT_CONN_CONNECT, TT_ROLE_CLIENT, args->ret, -1, a->addr);
    connect_inflight.delete(&id);
    return 0;
}

/* ---- runs: a streamed response's token writes, staged ---------------------------
 * An LLM server streams one whole chunk per token, all alike but for the text: the
 * size line, the same SSE head (id, model, created...), one JSON string, the same tail.
 * One DATA record per token is most of what a busy node sends, and most of the agent's
 * work. So once the agent has read a response's chunks, it arms the connection with
 * their template (run_arms: head and tail, from the agent's ChunkTemplate). A write
 * that is exactly such a chunk is then staged: its exit time and length join the
 * connection's run (run_stages), and no byte of its text is copied out (the agent
 * needs only that it was a token, and when). The run goes out as one RUN record when
 * it holds RUN_MAX writes, at the connection's next write once RUN_AGE_NS old, and
 * before any other record of the connection, so that a connection's records keep
 * their order: the response's last chunk, which is not a token, sends it. A write
 * the template does not fit disarms the connection (the agent arms the next response
 * again); one that fits but whose text is not a plain JSON string is sent as usual.
 * What a dead process had staged, the agent reads from the map.
 * The arm holds the template's head and tail as a hash each, not their bytes: the
 * written chunk is hot in the cache (the server just wrote it), an arm read between
 * the interpreter's own work is not, and 300 template bytes are five cold lines where
 * the hashes share one with the rest of the arm.
 */
struct run_arm {
    u64 conn_id;
    u32 seq;       /* the agent's arm number for the connection: RUN.arm */
    u16 head_len;  /* what follows the size line */
    u16 tail_len;  /* what ends the chunk, before its CRLF */
    u64 head_hash; /* run_hash of the head's bytes (tracer/events/wire.py run_hash) */
    u64 tail_hash; /* ...and of the tail's */
};
/* (tgid << 32 | fd) -> the template its token chunks have; written by the agent */
BPF_HASH(run_arms, u64, struct run_arm, 4096);

struct run_stage {
    struct tt_run r;
    u64 end; /* stream offset after its last write */
};
/* (tgid << 32 | fd) -> its run; kept (n = 0) between runs, deleted at close */
BPF_HASH(run_stages, u64, struct run_stage, 4096);
BPF_PERCPU_ARRAY(run_zero, struct run_stage, 1); /* never written: a zeroed value */

struct run_buf {
    u8 b[TT_RUN_WRITE_MAX + 8]; /* + 8: a word read at any masked index stays inside */
};
BPF_PERCPU_ARRAY(run_scratch, struct run_buf, 1);
/* [0]: run_exit, loaded and set by the agent (tracer/probes/loader.py) */
BPF_PROG_ARRAY(run_progs, 1);

#define RUN_MASK (TT_RUN_WRITE_MAX - 1)
#define RUN_TEXT_MAX 256 /* a token's JSON string longer than this is sent as usual */
#define RUN_NO_FIT (-1)  /* not the template's chunk: disarm */
#define RUN_ODD (-2)     /* the template's chunk, its string not plain: send it as usual */

/* An index into the scratch copy the verifier can bound: the compiler drops a mask it
 * can prove redundant, and the verifier, which tracks less, then rejects the access. */
static __always_inline u32 run_idx(u32 i)
{
    asm volatile("" : "+r"(i));
    return i & RUN_MASK;
}

static __always_inline void run_flush(u64 key, struct conn_state *st)
{
    struct run_stage *s = run_stages.lookup(&key);
    if (s && s->r.n) {
        submit(&s->r, sizeof(s->r), TT_CNT_LOST_RUN);
        s->r.n = 0;
    }
    st->staged = 0;
}

static __always_inline int run_hex(u8 c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The JSON string at [m0, m1) of the chunk: its length, or RUN_ODD unless it is one
 * JSON string: no quote or control byte inside but escaped, every backslash followed
 * by one of "\\/bfnrtu. (The four hex digits after \\u are not checked: a second
 * state variable in this loop cost the verifier more than a program may.) */
static __always_inline int run_string(struct run_buf *sb, u32 m0, u32 m1)
{
    if (m1 < m0 + 2 || m1 - m0 > RUN_TEXT_MAX)
        return RUN_ODD;
    if (sb->b[run_idx(m0)] != '"' || sb->b[run_idx(m1 - 1)] != '"')
        return RUN_ODD;
    u32 esc = 0;
    for (u32 i = 1; i < RUN_TEXT_MAX; i++) {
        u32 j = m0 + i;
        if (j >= m1 - 1)
            break;
        u8 c = sb->b[run_idx(j)];
        if (esc) {
            if (c != '"' && c != '\\' && c != '/' && c != 'b' && c != 'f' && c != 'n'
                && c != 'r' && c != 't' && c != 'u')
                return RUN_ODD;
            esc = 0;
        } else if (c == '\\') {
            esc = 1;
        } else if (c == '"' || c < 0x20) {
            return RUN_ODD;
        }
    }
    return esc ? RUN_ODD : (int)(m1 - m0);
}

#define RUN_HASH_K 0x9E3779B97F4A7C15ULL

static __always_inline u64 run_hash_step(u64 h, u64 w)
{
    return (((h << 5) | (h >> 59)) ^ w) * RUN_HASH_K;
}

/* run_hash of the n (<= max) bytes at the write's offset `at`: each little-endian
 * word of eight (the last zero-padded) folded in as h = (rotl(h, 5) ^ w) * K. Each
 * step is a bijection of h for a given word, so two byte strings of one length that
 * differ in one word never hash alike; tracer/events/wire.py run_hash is the same
 * function for the agent. Unaligned loads are fine on the JITs of x86-64 and arm64. */
static __always_inline u64 run_hash(struct run_buf *sb, u32 at, u32 n, u32 max)
{
    u32 words = n / 8;
    u64 h = 0;
    for (u32 i = 0; i < max / 8; i++) {
        if (i >= words)
            break;
        h = run_hash_step(h, *(u64 *)&sb->b[run_idx(at + i * 8)]);
    }
    if (n % 8) {
        u64 w = 0;
        for (u32 i = 0; i < 7; i++) {
            u32 j = words * 8 + i;
            if (j >= n || j >= max)
                break;
            w |= (u64)sb->b[run_idx(at + j)] << (8 * i);
        }
        h = run_hash_step(h, w);
    }
    return h;
}

/* Is the write [buf, buf + n) one whole chunk of the armed template? Its JSON
 * string's length, RUN_NO_FIT or RUN_ODD. */
static __always_inline int run_match(struct run_buf *sb, u64 buf, u32 n, struct run_arm *arm)
{
    if (n < 8 || n > TT_RUN_WRITE_MAX)
        return RUN_NO_FIT;
    /* n itself, in a form the verifier can bound (1..RUN_WRITE_MAX) */
    if (bpf_probe_read_user(sb->b, run_idx(n - 1) + 1, (void *)buf) != 0)
        return RUN_NO_FIT;
    /* the size line: at most 3 hex digits (the chunk is at most RUN_WRITE_MAX bytes) */
    u32 size = 0, h = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int v = run_hex(sb->b[i]);
        if (v < 0)
            break;
        size = size * 16 + (u32)v;
        h++;
    }
    if (h == 0 || h > 3 || sb->b[h & 3] != '\r' || sb->b[(h + 1) & 7] != '\n')
        return RUN_NO_FIT;
    if (size + h + 4 != n || sb->b[run_idx(n - 2)] != '\r'
        || sb->b[run_idx(n - 1)] != '\n')
        return RUN_NO_FIT;
    u32 hl = arm->head_len, tl = arm->tail_len;
    u32 start = h + 2;
    if (hl > TT_RUN_HEAD || tl > TT_RUN_TAIL || start + hl + 2 + tl + 2 > n)
        return RUN_NO_FIT;
    if (run_hash(sb, start, hl, TT_RUN_HEAD) != arm->head_hash)
        return RUN_NO_FIT;
    u32 t0 = n - 2 - tl;
    if (run_hash(sb, t0, tl, TT_RUN_TAIL) != arm->tail_hash)
        return RUN_NO_FIT;
    return run_string(sb, start + hl, t0);
}

/* Stage this write if it is a token chunk of the connection's armed template: 1 if
 * staged (nothing else to send), 0 to send it as usual (the caller sends the run
 * first). */
static __always_inline int run_stage(struct io_args *a, struct tt_data *d, long ret,
                                     u64 key, struct conn_state *st)
{
    struct run_arm *arm = run_arms.lookup(&key);
    if (!arm || arm->conn_id != a->conn_id)
        return 0;
    if ((u64)ret > config_get(TT_CFG_CAPTURE_LIMIT, 256 * 1024))
        return 0;
    u64 buf = a->buf;
    if (a->shape != SHAPE_BUF) {
        struct {
            u64 base;
            u64 len;
        } v = {};
        if (a->iovcnt != 1 || bpf_probe_read_user(&v, sizeof(v), (void *)a->buf) != 0
            || v.len < (u64)ret)
            return 0;
        buf = v.base;
    }
    u32 zero = 0;
    struct run_buf *sb = run_scratch.lookup(&zero);
    if (!sb)
        return 0;
    int fit = run_match(sb, buf, (u32)ret, arm);
    if (fit == RUN_NO_FIT) {
        run_arms.delete(&key);
        return 0;
    }
    if (fit < 2)
        return 0;
    struct run_stage *s = run_stages.lookup(&key);
    if (!s) {
        struct run_stage *z = run_zero.lookup(&zero);
        if (!z || run_stages.update(&key, z) != 0 || !(s = run_stages.lookup(&key))) {
            count(TT_CNT_RUNS_FULL);
            return 0;
        }
    }
    u32 n = s->r.n;
    if (n && (n >= TT_RUN_MAX || s->end != d->stream_off || s->r.tid != d->tid
              || s->r.arm != arm->seq || s->r.conn_id != a->conn_id
              || d->ts_exit - s->r.ts[0] >= TT_RUN_AGE_NS)) {
        submit(&s->r, sizeof(s->r), TT_CNT_LOST_RUN);
        n = 0;
    }
    if (n == 0) {
        s->r.kind = TT_KIND_RUN;
        s->r.pid = d->pid;
        s->r.tid = d->tid;
        s->r.fd = d->fd;
        s->r.conn_id = a->conn_id;
        s->r.stream_off = d->stream_off;
        s->r.arm = arm->seq;
    }
    if (n >= TT_RUN_MAX)
        return 0;
    s->r.ts[n] = d->ts_exit;
    s->r.len[n] = (u16)ret;
    s->r.n = n + 1;
    s->end = d->stream_off + (u64)ret;
    st->staged = 1;
    count(TT_CNT_RUN_WRITES);
    if (n + 1 >= TT_RUN_MAX) {
        submit(&s->r, sizeof(s->r), TT_CNT_LOST_RUN);
        s->r.n = 0;
        st->staged = 0;
    }
    return 1;
}

/* ---- close --------------------------------------------------------------------- */

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
    count_traced_runs(1); /* no exit probe */
    u64 key = conn_key(tgid, args->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st)
        return 0;
    struct tt_conn c = {};
    c.kind = TT_KIND_CONN;
    c.pid = tgid;
    c.tid = (u32)id;
    c.fd = args->fd;
    c.ts = bpf_ktime_get_ns();
    c.conn_id = st->conn_id;
    c.listen_fd = -1;
    c.op = TT_CONN_CLOSE;
    c.role = st->role;
    if (st->staged)
        run_flush(key, st);
    run_arms.delete(&key);
    run_stages.delete(&key);
    conns.delete(&key);
    submit(&c, sizeof(c), TT_CNT_LOST_CONN);
    return 0;
}

/* ---- peer addresses the syscalls did not give ----------------------------------
 * accept(fd, NULL, NULL), as libuv/uvloop call it, returns no peer, and reading it
 * from /proc later misses short connections. tcp_recvmsg fires this tracepoint in the
 * reading thread, inside the read syscall we already hold (io_call), with the
 * socket's own addresses: a stable tracepoint ABI, no kernel structs read. */
TRACEPOINT_PROBE(tcp, tcp_rcv_space_adjust)
{
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_call(id, 0);
    if (!a)
        return 0;
    count_traced_runs(1);
    u64 key = conn_key(id >> 32, a->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st)
        return 0;
#ifdef TT_NETWAIT
    {
        /* The verifier refuses loads through a ctx pointer moved to a field, which is
         * what clang makes of a 16-byte copy (and then shares with the copies below):
         * read through a copy of the pointer clang cannot see into. */
        u8 nw_l[16], nw_r[16];
        const u8 *p = (const u8 *)args;
        asm volatile("" : "+r"(p));
        bpf_probe_read_kernel(nw_l, 16, p + __builtin_offsetof(typeof(*args), saddr_v6));
        bpf_probe_read_kernel(nw_r, 16, p + __builtin_offsetof(typeof(*args), daddr_v6));
        nw_rcv_space(st, args->sport, args->dport, nw_l, nw_r);
    }
#endif
    if (st->peer_known)
        return 0;
    st->peer_known = 1;
    struct tt_conn c = {};
    c.kind = TT_KIND_CONN;
    c.pid = id >> 32;
    c.tid = (u32)id;
    c.fd = a->fd;
    c.ts = bpf_ktime_get_ns();
    c.conn_id = st->conn_id;
    c.ret = args->sport; /* local port */
    c.listen_fd = -1;
    c.op = TT_CONN_PEER;
    c.role = st->role;
    c.family = args->family;
    c.port = args->dport;
    if (args->family == 2 /* AF_INET */)
        __builtin_memcpy(c.addr, args->daddr, 4);
    else
        __builtin_memcpy(c.addr, args->daddr_v6, 16);
    submit(&c, sizeof(c), TT_CNT_LOST_CONN);
    return 0;
}

/* ---- data syscalls ------------------------------------------------------------- */

/* Hold a traced thread's data syscall: with task storage whatever the fd is, since
 * whether it is a socket we know, the exit asks `conns` as it must anyway (a socket's
 * call looks its connection up once); with the hash only a socket's, as an insert and
 * a delete for every file or pipe cost more than the look-up that spares them. */
static __always_inline int io_enter_as(struct io_args *a, u64 id, s32 fd, u64 buf, u32 iovcnt,
                                       u16 sys, u8 shape, u8 dir)
{
#ifndef TT_TASK_STORAGE
    u64 key = conn_key(id >> 32, fd);
    if (!conns.lookup(&key))
        return 0;
#endif
    a->buf = buf;
    a->ts_enter = bpf_ktime_get_ns();
    a->conn_id = 0;
    a->fd = fd;
    a->iovcnt = iovcnt;
    a->syscall = sys;
    a->shape = shape;
    a->direction = dir;
    io_call_hold(id, a);
    return 0;
}

static __always_inline int io_enter(s32 fd, u64 buf, u32 iovcnt, u16 sys, u8 shape, u8 dir)
{
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_call_slot(id);
    if (!a)
        return 0;
    return io_enter_as(a, id, fd, buf, iovcnt, sys, shape, dir);
}

/* msghdr: the iovec array pointer and count sit at offsets 16 and 24 (user ABI). Read
 * for traced threads only. */
static __always_inline int msg_enter(s32 fd, u64 umsg, u16 sys, u8 dir)
{
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_call_slot(id);
    if (!a)
        return 0;
    struct {
        u64 name;
        u64 namelen;
        u64 iov;
        u64 iovlen;
    } m = {};
    if (bpf_probe_read_user(&m, sizeof(m), (void *)umsg) != 0)
        return 0;
    return io_enter_as(a, id, fd, m.iov, (u32)m.iovlen, sys, SHAPE_IOV, dir);
}

static __always_inline void emit_chunk(struct tt_data *d, u64 off, u32 len, u8 flags)
{
    d->offset = off;
    d->len = len;
    d->flags = flags;
    submit(d, TT_TT_DATA_HDR + len, TT_CNT_LOST_DATA);
}

struct copy_ctx {
    u64 base;   /* user address of the current buffer */
    u64 left;   /* bytes left in it */
    u64 iov;    /* iovec array, 0 for a plain buffer */
    u64 done;   /* bytes captured so far, the record being filled included */
    u64 want;   /* bytes to capture: min(ret, capture limit) */
    u32 idx;    /* next iovec to load */
    u32 iovcnt;
    u32 fill;   /* bytes in the record being filled, not yet sent */
    u8 trunc;
};

/*
 * The copy loop's state lives in a per-CPU map value, not in registers: values loaded
 * from a map are opaque to the verifier, so the states it sees at the loop head differ
 * only in the loop counter and are pruned. With the state in registers, every
 * data-dependent branch doubled the paths to check and the program was rejected.
 */
BPF_PERCPU_ARRAY(copy_state, struct copy_ctx, 1);

/*
 * One pass: load the next iovec, or copy a piece of the current buffer into the record
 * being filled; the record goes out once it holds TT_CHUNK / 2 bytes or more, or the
 * syscall's bytes are all in. So the iovecs of one sendmsg (gRPC's frame headers and
 * messages: five a call) share a record instead of taking one each. Returns 1 to stop
 * the loop.
 *
 * Why half: the verifier cannot relate a piece's length to the fill, so each copy must
 * fit the payload whatever both are within their bounds. An empty record takes a piece
 * of up to TT_CHUNK at its start; a part-filled one (fill below TT_CHUNK / 2, masked to
 * say so) takes a piece of up to TT_CHUNK / 2. A large buffer still goes out in
 * records of TT_CHUNK.
 */
static __always_inline int copy_step(struct copy_ctx *c, struct tt_data *d)
{
    if (c->done >= c->want)
        return 1;
    if (c->left == 0) {
        if (c->idx >= c->iovcnt || c->idx >= TT_MAX_IOV)
            return 1;
        struct {
            u64 base;
            u64 len;
        } v = {};
        bpf_probe_read_user(&v, sizeof(v), (void *)(c->iov + (u64)c->idx * 16));
        c->idx++;
        c->base = v.base;
        c->left = v.len;
        return 0;
    }
    u64 n = c->want - c->done;
    if (n > c->left)
        n = c->left;
    u32 fill = c->fill;
    u32 len;
    if (fill == 0) {
        len = n > TT_CHUNK ? TT_CHUNK : (u32)n;
        if (len == 0 || len > TT_CHUNK)
            return 1;
        if (bpf_probe_read_user(d->payload, len, (void *)c->base) != 0)
            return 1; /* unmapped buffer: copy_out reports the rest as truncated */
    } else {
        fill &= TT_CHUNK / 2 - 1; /* below TT_CHUNK / 2 here: the record went out else */
        len = n > TT_CHUNK / 2 ? TT_CHUNK / 2 : (u32)n;
        if (len == 0 || len > TT_CHUNK / 2)
            return 1;
        if (bpf_probe_read_user(&d->payload[fill], len, (void *)c->base) != 0)
            return 1;
    }
    fill += len;
    c->done += len;
    c->base += len;
    c->left -= len;
    c->fill = fill;
    if (fill >= TT_CHUNK / 2 || c->done >= c->want) {
        u8 last = c->done >= c->want ? TT_FLAG_LAST : 0;
        emit_chunk(d, c->done - fill, fill, c->trunc | last);
        c->fill = 0;
    }
    return 0;
}

/*
 * Send ``want`` bytes from ``c``'s buffers as DATA records of ``d``: the copy loop,
 * then what the last record holds, then, if the loop ran out of iterations or iovecs
 * or met an unmapped buffer, a marker at the first byte not sent, so the agent knows
 * exactly how many it did not get. ``cut_flags`` go on that marker (TLS's flag).
 */
static __always_inline void copy_out(struct copy_ctx *c, struct tt_data *d, u8 cut_flags)
{
    c->done = 0;
    c->idx = 0;
    c->fill = 0;
    for (int i = 0; i < TT_MAX_ITER; i++) {
        if (copy_step(c, d))
            break;
    }
    u64 done = c->done;
    if (done >= c->want)
        return;
    u32 fill = c->fill & (TT_CHUNK / 2 - 1); /* a part-filled record is below half */
    if (fill)
        emit_chunk(d, done - fill, fill, c->trunc);
    count(TT_CNT_IOV_CUT);
    emit_chunk(d, done, 0, TT_FLAG_LAST | TT_FLAG_TRUNCATED | cut_flags);
}

/* Send the syscall's record(s): its bytes in DATA records of up to TT_CHUNK (copy_out),
 * and forget it. */
static __always_inline int io_send(u64 id, struct io_args *a, struct tt_data *d, long ret)
{
    if (ret <= 0) {
        emit_chunk(d, 0, 0, TT_FLAG_LAST | (ret == 0 ? TT_FLAG_EOF : TT_FLAG_ERROR));
        io_call_done(id, a);
        return 0;
    }

    u64 limit = config_get(TT_CFG_CAPTURE_LIMIT, 256 * 1024);
    u64 want = (u64)ret < limit ? (u64)ret : limit;
    u8 trunc = want < (u64)ret ? TT_FLAG_TRUNCATED : 0;
    if (trunc)
        count(TT_CNT_TRUNCATED);

    u32 zero = 0;
    struct copy_ctx *c = copy_state.lookup(&zero);
    if (!c) {
        io_call_done(id, a);
        return 0;
    }
    c->want = want;
    c->trunc = trunc;
    if (a->shape == SHAPE_BUF) {
        c->base = a->buf;
        c->left = ret;
        c->iov = 0;
        c->iovcnt = 0;
    } else {
        c->base = 0;
        c->left = 0;
        c->iov = a->buf;
        c->iovcnt = a->iovcnt;
    }
    copy_out(c, d, 0);
    io_call_done(id, a);
    return 0;
}

#ifdef TT_TLS
#define TT_W4(a, b, c, d) ((u32)(a) | (u32)(b) << 8 | (u32)(c) << 16 | (u32)(d) << 24)
/* Whether a syscall's bytes, the first its connection moved that way, open plaintext
 * HTTP: a request line, a status line, or the HTTP/2 preface. Such a connection stays
 * plaintext (HTTP's switch to TLS is not in use), so the TLS probes' checks, a few
 * look-ups a syscall, are skipped for it from there on. Anything else keeps them: a TLS
 * record, or a protocol that may start TLS later (PostgreSQL's SSLRequest). */
static __always_inline int is_plain_http(struct io_args *a, long ret)
{
    if (ret < 4)
        return 0;
    u64 base = a->buf;
    if (a->shape != SHAPE_BUF
        && (!a->iovcnt || bpf_probe_read_user(&base, sizeof(base), (void *)a->buf) != 0))
        return 0;
    u32 w = 0;
    if (bpf_probe_read_user(&w, sizeof(w), (void *)base) != 0)
        return 0;
    return w == TT_W4('G', 'E', 'T', ' ') || w == TT_W4('P', 'O', 'S', 'T')
           || w == TT_W4('P', 'U', 'T', ' ') || w == TT_W4('H', 'E', 'A', 'D')
           || w == TT_W4('D', 'E', 'L', 'E') || w == TT_W4('O', 'P', 'T', 'I')
           || w == TT_W4('P', 'A', 'T', 'C') || w == TT_W4('H', 'T', 'T', 'P')
           || w == TT_W4('P', 'R', 'I', ' ');
}
#endif

static __always_inline int io_exit(void *ctx, long ret, u16 sys)
{
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_call(id, sys);
    if (!a)
        return 0;
    u64 key = conn_key(id >> 32, a->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st) {
        io_call_done(id, a); /* not a socket we know: a file, pipe or eventfd */
        return 0;
    }
    a->conn_id = st->conn_id;
#ifdef TT_TLS
    if (!st->tls_plain)
        tls_io_enter(id, a->fd, st->conn_id); /* inside an SSL call: its object's socket */
#endif
    /* Would-block and interrupted calls moved nothing: not worth a record. */
    if (ret == -11 || ret == -4) {
        io_call_done(id, a);
        return 0;
    }
    u32 zero = 0;
    struct tt_data *d = data_scratch.lookup(&zero);
    if (!d) {
        io_call_done(id, a);
        return 0;
    }
    d->kind = TT_KIND_DATA;
    d->pid = id >> 32;
    d->tid = (u32)id;
    d->fd = a->fd;
    d->conn_id = a->conn_id;
    d->ts_enter = a->ts_enter;
    d->ts_exit = bpf_ktime_get_ns();
    d->ret = ret;
    d->syscall = a->syscall;
    d->direction = a->direction;
    d->pad = 0;
    d->stream_off = 0;
    if (ret > 0) {
        if (a->direction == TT_DIR_IN)
            d->stream_off = __sync_fetch_and_add(&st->bytes_in, ret);
        else
            d->stream_off = __sync_fetch_and_add(&st->bytes_out, ret);
    }
#ifdef TT_NETWAIT
    if (ret > 0)
        nw_io_exit(a, d, ret, st);
#endif

#ifdef TT_TLS
    if (ret > 0 && d->stream_off == 0 && !st->tls_plain && is_plain_http(a, ret))
        st->tls_plain = 1;
    if (ret > 0 && !st->tls_plain && tls_io_exit(id, a, ret)) {
        /* ciphertext whose plaintext comes from the TLS probes: its place, not its bytes */
        emit_chunk(d, 0, 0, TT_FLAG_LAST | TT_FLAG_CIPHER);
        io_call_done(id, a);
        return 0;
    }
#endif
    if (ret > 0 && a->direction == TT_DIR_OUT) {
        struct run_arm *arm = run_arms.lookup(&key);
        if (arm && arm->conn_id == a->conn_id)
            run_progs.call(ctx, 0); /* run_exit; returns here only if it is not loaded */
    }
    if (st->staged)
        run_flush(key, st); /* before any other record of the connection */
    return io_send(id, a, d, ret);
}

/*
 * A write on an armed connection, tail-called from io_exit (which filled data_scratch
 * and left the call in flight): staged if it is a token chunk of the template,
 * else sent as io_exit would. A program of its own so that the verifier checks the
 * template's loops once, not in each of the eight exit probes (seconds of load time).
 */
int run_exit(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_call(id, 0);
    u32 zero = 0;
    struct tt_data *d = data_scratch.lookup(&zero);
    if (!a || !d)
        return 0;
    long ret = d->ret;
    u64 key = conn_key(id >> 32, a->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st) {
        io_call_done(id, a);
        return 0;
    }
    if (ret > 0 && run_stage(a, d, ret, key, st)) {
        io_call_done(id, a);
        return 0;
    }
    if (st->staged)
        run_flush(key, st);
    return io_send(id, a, d, ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_read)
{
    return io_enter(args->fd, (u64)args->buf, BUF_SIZE(args->count), TT_SYS_READ, SHAPE_BUF,
                    TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return io_exit(args, args->ret, TT_SYS_READ); }

TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
    return io_enter(args->fd, (u64)args->buf, 0, TT_SYS_WRITE, SHAPE_BUF, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return io_exit(args, args->ret, TT_SYS_WRITE); }

TRACEPOINT_PROBE(syscalls, sys_enter_readv)
{
    return io_enter(args->fd, (u64)args->vec, args->vlen, TT_SYS_READV, SHAPE_IOV, TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return io_exit(args, args->ret, TT_SYS_READV); }

TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
    return io_enter(args->fd, (u64)args->vec, args->vlen, TT_SYS_WRITEV, SHAPE_IOV, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return io_exit(args, args->ret, TT_SYS_WRITEV); }

TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom)
{
    return io_enter(args->fd, (u64)args->ubuf, BUF_SIZE(args->size), TT_SYS_RECVFROM,
                    SHAPE_BUF, TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return io_exit(args, args->ret, TT_SYS_RECVFROM); }

TRACEPOINT_PROBE(syscalls, sys_enter_sendto)
{
    return io_enter(args->fd, (u64)args->buff, 0, TT_SYS_SENDTO, SHAPE_BUF, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return io_exit(args, args->ret, TT_SYS_SENDTO); }

TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg)
{
    return msg_enter(args->fd, (u64)args->msg, TT_SYS_RECVMSG, TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return io_exit(args, args->ret, TT_SYS_RECVMSG); }

TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg)
{
    return msg_enter(args->fd, (u64)args->msg, TT_SYS_SENDMSG, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return io_exit(args, args->ret, TT_SYS_SENDMSG); }
