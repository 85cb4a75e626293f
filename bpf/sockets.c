/*
 * Socket syscalls of traced processes: connection lifecycle (accept, connect, close)
 * and the bytes of every data syscall that Python and native servers use (read, write,
 * readv, writev, recvfrom, sendto, recvmsg, sendmsg).
 *
 * Only file descriptors known to be sockets are captured: accept/connect put them in
 * `conns`, and Python adds the sockets a process already had at attach. Reads of plain
 * files therefore cost one map lookup and nothing else.
 *
 * Payload: entry saves the buffer (or iovec array) pointer, exit copies up to the
 * capture limit in TT_CHUNK pieces, each its own DATA record, the last one flagged.
 * Each direction of a connection keeps a byte counter, so Python can tell exactly
 * where a lost or truncated record left a gap in the stream.
 */

#define SHAPE_BUF 0 /* one buffer */
#define SHAPE_IOV 1 /* iovec array (readv/writev, and msghdr resolved at entry) */
/* a plain read's size, kept in io_args.iovcnt (unused for one buffer) */
#define BUF_SIZE(n) ((n) > 0xffffffffUL ? 0xffffffffU : (u32)(n))

struct conn_state {
    u64 conn_id;
    u64 bytes_in;  /* stream offsets, advanced atomically at each syscall exit */
    u64 bytes_out;
    u32 role;
    u32 peer_known; /* 0 until the peer address has been sent to user space */
};
/* (tgid << 32 | fd) -> connection */
BPF_HASH(conns, u64, struct conn_state, 65536);

struct io_args {
    u64 buf;
    u64 ts_enter;
    u64 conn_id;
    s32 fd;
    u32 iovcnt;  /* iovec count; a plain read's buffer size (netwait: short read) */
    u16 syscall;
    u8 shape;
    u8 direction;
    u32 pad;
};
/* pid_tgid -> the data syscall in flight on that thread */
BPF_HASH(io_inflight, u64, struct io_args, 16384);

#ifdef TT_TLS
/* bpf/tls.c (appended after this file): which socket an SSL object belongs to, and
 * ciphertext of sockets whose plaintext the TLS probes follow */
static __always_inline void tls_io_enter(u64 id, s32 fd, u64 conn_id);
static __always_inline int tls_io_exit(u64 id, struct io_args *a, long ret);
#endif

#ifdef TT_NETWAIT
/* bpf/netwait.c (appended after this file): when the kernel held the bytes */
static __always_inline void nw_rcv_space(u64 id, struct io_args *a, u16 lport, u16 rport,
                                         const u8 *laddr, const u8 *raddr);
static __always_inline void nw_io_exit(struct io_args *a, struct tt_data *d, long ret);
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

/* ---- close --------------------------------------------------------------------- */

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
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
    conns.delete(&key);
    submit(&c, sizeof(c), TT_CNT_LOST_CONN);
    return 0;
}

/* ---- peer addresses the syscalls did not give ----------------------------------
 * accept(fd, NULL, NULL), as libuv/uvloop call it, returns no peer, and reading it
 * from /proc later misses short connections. tcp_recvmsg fires this tracepoint in the
 * reading thread, inside the read syscall we already hold in io_inflight, with the
 * socket's own addresses: a stable tracepoint ABI, no kernel structs read. */
TRACEPOINT_PROBE(tcp, tcp_rcv_space_adjust)
{
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_inflight.lookup(&id);
    if (!a)
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
        nw_rcv_space(id, a, args->sport, args->dport, nw_l, nw_r);
    }
#endif
    u64 key = conn_key(id >> 32, a->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st || st->peer_known || st->conn_id != a->conn_id)
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

static __always_inline int io_enter(s32 fd, u64 buf, u32 iovcnt, u16 sys, u8 shape, u8 dir)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
    u64 key = conn_key(tgid, fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st)
        return 0; /* not a socket we know: a file, pipe or eventfd */
#ifdef TT_TLS
    tls_io_enter(id, fd, st->conn_id);
#endif
    struct io_args a = {};
    a.buf = buf;
    a.ts_enter = bpf_ktime_get_ns();
    a.conn_id = st->conn_id;
    a.fd = fd;
    a.iovcnt = iovcnt;
    a.syscall = sys;
    a.shape = shape;
    a.direction = dir;
    if (io_inflight.update(&id, &a) != 0)
        count(TT_CNT_INFLIGHT_FULL);
    return 0;
}

/* msghdr: the iovec array pointer and count sit at offsets 16 and 24 (user ABI). */
static __always_inline int msg_enter(s32 fd, u64 umsg, u16 sys, u8 dir)
{
    struct {
        u64 name;
        u64 namelen;
        u64 iov;
        u64 iovlen;
    } m = {};
    if (bpf_probe_read_user(&m, sizeof(m), (void *)umsg) != 0)
        return 0;
    return io_enter(fd, m.iov, (u32)m.iovlen, sys, SHAPE_IOV, dir);
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
    u64 done;   /* bytes captured so far */
    u64 want;   /* bytes to capture: min(ret, capture limit) */
    u32 idx;    /* next iovec to load */
    u32 iovcnt;
    u8 trunc;
};

/*
 * The copy loop's state lives in a per-CPU map value, not in registers: values loaded
 * from a map are opaque to the verifier, so the states it sees at the loop head differ
 * only in the loop counter and are pruned. With the state in registers, every
 * data-dependent branch doubled the paths to check and the program was rejected.
 */
BPF_PERCPU_ARRAY(copy_state, struct copy_ctx, 1);

/* One pass: load the next iovec, or send one chunk. Returns 1 to stop the loop. */
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
    u32 len = n > TT_CHUNK ? TT_CHUNK : (u32)n;
    if (len == 0 || len > TT_CHUNK)
        return 1;
    if (bpf_probe_read_user(d->payload, len, (void *)c->base) != 0)
        return 1; /* unmapped buffer: the caller reports the rest as truncated */
    u8 last = (c->done + len >= c->want) ? TT_FLAG_LAST : 0;
    emit_chunk(d, c->done, len, c->trunc | last);
    c->done += len;
    c->base += len;
    c->left -= len;
    return 0;
}

static __always_inline int io_exit(long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_inflight.lookup(&id);
    if (!a)
        return 0;
    /* Would-block and interrupted calls moved nothing: not worth a record. */
    if (ret == -11 || ret == -4) {
        io_inflight.delete(&id);
        return 0;
    }
    u32 zero = 0;
    struct tt_data *d = data_scratch.lookup(&zero);
    if (!d) {
        io_inflight.delete(&id);
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

    u64 key = conn_key(id >> 32, a->fd);
    struct conn_state *st = conns.lookup(&key);
    if (st && ret > 0) {
        if (a->direction == TT_DIR_IN)
            d->stream_off = __sync_fetch_and_add(&st->bytes_in, ret);
        else
            d->stream_off = __sync_fetch_and_add(&st->bytes_out, ret);
    }
#ifdef TT_NETWAIT
    if (ret > 0)
        nw_io_exit(a, d, ret);
#endif

#ifdef TT_TLS
    if (ret > 0 && tls_io_exit(id, a, ret)) {
        /* ciphertext whose plaintext comes from the TLS probes: its place, not its bytes */
        emit_chunk(d, 0, 0, TT_FLAG_LAST | TT_FLAG_CIPHER);
        io_inflight.delete(&id);
        return 0;
    }
#endif
    if (ret <= 0) {
        emit_chunk(d, 0, 0, TT_FLAG_LAST | (ret == 0 ? TT_FLAG_EOF : TT_FLAG_ERROR));
        io_inflight.delete(&id);
        return 0;
    }

    u64 limit = config_get(TT_CFG_CAPTURE_LIMIT, 256 * 1024);
    u64 want = (u64)ret < limit ? (u64)ret : limit;
    u8 trunc = want < (u64)ret ? TT_FLAG_TRUNCATED : 0;
    if (trunc)
        count(TT_CNT_TRUNCATED);

    struct copy_ctx *c = copy_state.lookup(&zero);
    if (!c) {
        io_inflight.delete(&id);
        return 0;
    }
    c->want = want;
    c->trunc = trunc;
    c->done = 0;
    c->idx = 0;
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
    for (int i = 0; i < TT_MAX_ITER; i++) {
        if (copy_step(c, d))
            break;
    }
    u64 done = c->done;
    if (done < want) {
        /* Ran out of iterations or iovecs: close the syscall with a marker so Python
         * knows exactly how many bytes it did not get. */
        count(TT_CNT_IOV_CUT);
        emit_chunk(d, done, 0, TT_FLAG_LAST | TT_FLAG_TRUNCATED);
    }
    io_inflight.delete(&id);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_read)
{
    return io_enter(args->fd, (u64)args->buf, BUF_SIZE(args->count), TT_SYS_READ, SHAPE_BUF,
                    TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return io_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
    return io_enter(args->fd, (u64)args->buf, 0, TT_SYS_WRITE, SHAPE_BUF, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return io_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_readv)
{
    return io_enter(args->fd, (u64)args->vec, args->vlen, TT_SYS_READV, SHAPE_IOV, TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return io_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
    return io_enter(args->fd, (u64)args->vec, args->vlen, TT_SYS_WRITEV, SHAPE_IOV, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return io_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom)
{
    return io_enter(args->fd, (u64)args->ubuf, BUF_SIZE(args->size), TT_SYS_RECVFROM,
                    SHAPE_BUF, TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return io_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_sendto)
{
    return io_enter(args->fd, (u64)args->buff, 0, TT_SYS_SENDTO, SHAPE_BUF, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return io_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg)
{
    return msg_enter(args->fd, (u64)args->msg, TT_SYS_RECVMSG, TT_DIR_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return io_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg)
{
    return msg_enter(args->fd, (u64)args->msg, TT_SYS_SENDMSG, TT_DIR_OUT);
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return io_exit(args->ret); }
