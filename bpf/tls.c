/*
 * TLS plaintext at the TLS library's boundary: SSL_read, SSL_read_ex, SSL_write and
 * SSL_write_ex of OpenSSL 1.1 and 3.x (libssl), probed in each traced process
 * (tracer/probes/tls.py finds the library in /proc/PID/maps). What an SSL call moved
 * goes out as ordinary DATA records flagged TT_FLAG_TLS, with the fd and conn_id of the
 * socket the SSL object belongs to and stream offsets of its own, so the same parsers
 * read it as they read a plain socket.
 *
 * Which socket an SSL object belongs to, learned once per object (TLS BIND record):
 *   - SSL_set_fd(ssl, fd): the socket, named.
 *   - a socket BIO: the read or write syscall the thread makes inside an SSL call
 *     (sockets.c calls tls_io_enter()).
 *   - a memory BIO (Python's ssl.SSLObject under asyncio and uvloop, gRPC's BIO pairs):
 *     there is no fd and the SSL calls make no syscall. The event loop reads ciphertext
 *     from the socket and feeds it to the read BIO (BIO_write) on the same thread, and
 *     sends what the SSL object wrote to its write BIO. So: a BIO_write outside SSL calls
 *     of exactly the bytes the thread's last socket read returned (length and first
 *     TT_TLS_HEAD bytes equal) ties that BIO to the socket, and the object reading from
 *     it is tied too: named by SSL_set_bio, or seen calling BIO_read on it inside an SSL
 *     call (where BIO_read is probed: only where its probe is cheap, tracer/probes/tls.py);
 *     and the first TT_TLS_HEAD bytes of each record an unbound object writes to its BIO
 *     (5-byte record header, then the hello's random or the ciphertext) are remembered,
 *     and the socket whose next send starts with them is its socket. Both handshake
 *     directions read and write before any application data, so a new connection is
 *     tied before its first request; one opened before attach (its SSL_set_bio unseen),
 *     at its first read (BIO_read probed) or else its first write: the request read
 *     before that is counted, not sent.
 * Every match compares bytes, never guesses by time; an SSL object never tied to a
 * socket moves plaintext that is counted (tls_counters), not sent.
 *
 * Cost: a uprobe on an instruction the kernel cannot emulate (`sub $n,%rsp`, the first
 * instruction of most of these functions in Debian's build) is single-stepped, ~10 us a
 * hit on the development VM; tracer/probes/tls.py puts the probes on the internal
 * functions the exported ones wrap where that is provable (they begin with `push`,
 * emulated: ~2 us), and probes BIO_read (twice per record read) only there
 * (bench/tls.py, docs/tls.md).
 *
 * The ciphertext syscalls of a socket whose SSL object completed its handshake are
 * still recorded (stream offsets and times: socket-level timing), without payload
 * (TT_FLAG_CIPHER): the handshake's own bytes are captured in full, so user space can
 * read the TLS version from the ServerHello.
 *
 * Appended after sockets.c (it uses `conns`, struct io_args and copy_out()); sockets.c
 * calls tls_io_enter() and tls_io_exit() when compiled with TT_TLS.
 */

#define TLS_OP_READ 1
#define TLS_OP_WRITE 2
#define TLS_OP_HANDSHAKE 3
#define TLS_OP_EX 0x10     /* SSL_*_ex: the byte count is written through the 4th arg */
#define TLS_OP_EX2 0x20    /* SSL_write_ex2 (OpenSSL 3.3+): ...through the 5th */
#define TLS_S_STARTED 0x100 /* a handshake call, or a data call that moved nothing, came
                             * before the object was established: a failure if freed so */
#define TLS_EGRESS_MAX_NS 1000000000ULL /* a record is sent within microseconds of its
                                         * write to the BIO: older matches are not taken */

struct tls_key {
    u32 tgid;
    u32 pad;
    u64 ptr; /* an SSL* or a BIO* of that process */
};

struct tls_ssl {
    u64 conn_id; /* the socket it is tied to; 0: none yet */
    u64 pt_in;   /* plaintext read through it: its DATA records' stream offset */
    u64 pt_out;
    u64 rbio;    /* its read BIO (SSL_set_bio), 0 if unseen */
    s32 fd;
    u32 flags;   /* TT_TLS_F_* and TLS_S_* */
};
BPF_TABLE("lru_hash", struct tls_key, struct tls_ssl, tls_ssls, 65536);

/* (tgid, BIO*) -> the SSL object that reads from it (SSL_set_bio) */
BPF_TABLE("lru_hash", struct tls_key, u64, tls_rbios, 65536);

/* (tgid, BIO*) -> the socket whose bytes it was fed, for a BIO no SSL_set_bio named (an
 * object set up before attach): its object is found by its BIO_read */
struct tls_bio {
    u64 conn_id;
    s32 fd;
    u32 pad;
};
BPF_TABLE("lru_hash", struct tls_key, struct tls_bio, tls_bios, 65536);

/* (tgid << 32 | fd) -> the SSL object of that socket; ciphertext goes without payload
 * once it is established */
struct tls_sock {
    u64 conn_id;
    u64 ssl;
    u32 established;
    u32 pad;
};
BPF_TABLE("lru_hash", u64, struct tls_sock, tls_socks, 65536);

/* pid_tgid -> the SSL call in flight on that thread */
struct tls_call {
    u64 ssl;
    u64 buf;
    u64 out;   /* SSL_*_ex: size_t *readbytes / *written */
    u64 ts;
    u64 sp;    /* stack pointer at entry: a deeper call is nested, a shallower one means
                * this call's return was never seen (its entry is stale) */
    u32 op;
    u32 depth; /* nested SSL calls (SSL_accept -> SSL_do_handshake): ignored */
};
BPF_HASH(tls_calls, u64, struct tls_call, 16384);

/* pid_tgid -> the thread's last socket read outside SSL calls (memory BIOs) */
struct tls_in {
    u64 conn_id;
    s32 fd;
    u32 len;
    u8 head[TT_TLS_HEAD];
};
BPF_HASH(tls_last_in, u64, struct tls_in, 16384);

/* (tgid, first bytes of a record an unbound SSL object wrote to its BIO) -> the SSL */
struct tls_head_key {
    u32 tgid;
    u8 head[TT_TLS_HEAD];
};
struct tls_head {
    u64 ssl;
    u64 ts;
};
BPF_TABLE("lru_hash", struct tls_head_key, struct tls_head, tls_egress, 8192);

/* tgid -> 1: processes that made SSL calls; the socket probes look for TLS only there */
BPF_HASH(tls_procs, u32, u32, 16384);

BPF_PERCPU_ARRAY(tls_counters, u64, TT_TLS_N_COUNTERS);
/* scratch of their own: a uprobe program can be preempted by a syscall's */
BPF_PERCPU_ARRAY(tls_scratch, struct tt_data, 1);
BPF_PERCPU_ARRAY(tls_copy, struct copy_ctx, 1);

static __always_inline void tls_count(u32 which, u64 n)
{
    u64 *c = tls_counters.lookup(&which);
    if (c)
        *c += n;
}

static __always_inline struct tls_ssl *tls_state(u32 tgid, u64 ssl, u32 flags)
{
    struct tls_key k = {.tgid = tgid, .ptr = ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (s)
        return s;
    struct tls_ssl fresh = {.fd = -1, .flags = flags};
    if (tls_ssls.update(&k, &fresh) != 0) {
        tls_count(TT_TLS_CNT_STATE_FULL, 1);
        return NULL;
    }
    return tls_ssls.lookup(&k);
}

static __always_inline void tls_record(u64 id, u64 ssl, struct tls_ssl *s, u16 op, u16 via)
{
    struct tt_tls r = {};
    r.kind = TT_KIND_TLS;
    r.pid = id >> 32;
    r.tid = (u32)id;
    r.fd = s->conn_id ? s->fd : -1;
    r.conn_id = s->conn_id;
    r.ts = bpf_ktime_get_ns();
    r.ssl = ssl;
    r.op = op;
    r.via = via;
    r.flags = s->flags & (TT_TLS_F_FRESH | TT_TLS_F_ESTABLISHED | TT_TLS_F_FAILED);
    r.bytes_in = s->pt_in;
    r.bytes_out = s->pt_out;
    if (ring_out(&r, sizeof(r), BPF_RB_NO_WAKEUP) != 0)
        tls_count(TT_TLS_CNT_LOST, 1);
}

static __always_inline void tls_sock_set(u32 tgid, struct tls_ssl *s, u64 ssl)
{
    u64 key = conn_key(tgid, s->fd);
    struct tls_sock ts = {.conn_id = s->conn_id, .ssl = ssl,
                          .established = (s->flags & TT_TLS_F_ESTABLISHED) ? 1 : 0};
    if (tls_socks.update(&key, &ts) != 0)
        tls_count(TT_TLS_CNT_STATE_FULL, 1);
}

/* Tie ``ssl`` to the socket (fd, conn_id); a BIND record says so. */
static __always_inline void tls_bind(u64 id, u64 ssl, struct tls_ssl *s, s32 fd, u64 conn_id,
                                     u16 via)
{
    if (s->conn_id == conn_id && s->fd == fd)
        return;
    s->conn_id = conn_id;
    s->fd = fd;
    tls_sock_set(id >> 32, s, ssl);
    tls_count(TT_TLS_CNT_BINDS, 1);
    tls_record(id, ssl, s, TT_TLS_BIND, via);
}

static __always_inline void tls_established(u64 id, u64 ssl, struct tls_ssl *s)
{
    if (s->flags & TT_TLS_F_ESTABLISHED)
        return;
    s->flags |= TT_TLS_F_ESTABLISHED;
    if (!s->conn_id)
        return; /* said with its BIND, if it ever comes */
    tls_sock_set(id >> 32, s, ssl);
    tls_record(id, ssl, s, TT_TLS_ESTABLISHED, 0);
}

/* A call that completed no handshake and moved nothing. Only an object seen from its
 * setup is then known to be mid-handshake: one met later (a connection from before
 * attach) was most likely established long ago, and just found nothing to read. */
static __always_inline void tls_started(struct tls_ssl *s)
{
    if ((s->flags & TT_TLS_F_FRESH) && !(s->flags & TT_TLS_F_ESTABLISHED))
        s->flags |= TLS_S_STARTED;
}

/* ---- SSL calls ------------------------------------------------------------------ */

static __always_inline int tls_enter(struct pt_regs *ctx, u32 op)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
    u64 sp = PT_REGS_SP(ctx);
    struct tls_call *cur = tls_calls.lookup(&id);
    if (cur && sp < cur->sp) {
        cur->depth++;
        tls_count(TT_TLS_CNT_NESTED, 1);
        return 0;
    }
    struct tls_call c = {};
    c.ssl = PT_REGS_PARM1(ctx);
    c.buf = PT_REGS_PARM2(ctx);
    c.out = (op & TLS_OP_EX2) ? PT_REGS_PARM5(ctx) : (op & TLS_OP_EX) ? PT_REGS_PARM4(ctx) : 0;
    c.ts = bpf_ktime_get_ns();
    c.sp = sp;
    c.op = op;
    if (tls_calls.update(&id, &c) != 0) {
        tls_count(TT_TLS_CNT_INFLIGHT_FULL, 1);
        return 0;
    }
    if (!tls_procs.lookup(&tgid)) {
        u32 one = 1;
        tls_procs.update(&tgid, &one);
    }
    /* an object first met in a handshake is seen from its start */
    tls_state(tgid, c.ssl, op == TLS_OP_HANDSHAKE ? TT_TLS_F_FRESH : 0);
    return 0;
}

int tt_tls_read(struct pt_regs *ctx) { return tls_enter(ctx, TLS_OP_READ); }
int tt_tls_read_ex(struct pt_regs *ctx) { return tls_enter(ctx, TLS_OP_READ | TLS_OP_EX); }
int tt_tls_write(struct pt_regs *ctx) { return tls_enter(ctx, TLS_OP_WRITE); }
int tt_tls_write_ex(struct pt_regs *ctx) { return tls_enter(ctx, TLS_OP_WRITE | TLS_OP_EX); }
int tt_tls_write_ex2(struct pt_regs *ctx)
{
    return tls_enter(ctx, TLS_OP_WRITE | TLS_OP_EX | TLS_OP_EX2);
}
int tt_tls_handshake(struct pt_regs *ctx) { return tls_enter(ctx, TLS_OP_HANDSHAKE); }

/* The plaintext an SSL call moved, as DATA records of its socket (TT_FLAG_TLS). */
static __always_inline void tls_data(u64 id, struct tls_call *c, struct tls_ssl *s, u64 n)
{
    u32 tgid = id >> 32;
    u8 dir = (c->op & 0xf) == TLS_OP_READ ? TT_DIR_IN : TT_DIR_OUT;
    tls_count(TT_TLS_CNT_CALLS, 1);
    if (!s->conn_id) {
        tls_count(TT_TLS_CNT_UNBOUND, 1);
        tls_count(TT_TLS_CNT_UNBOUND_BYTES, n);
        return;
    }
    u64 key = conn_key(tgid, s->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st || st->conn_id != s->conn_id) {
        tls_count(TT_TLS_CNT_STALE, 1);
        return;
    }
    u32 zero = 0;
    struct tt_data *d = tls_scratch.lookup(&zero);
    struct copy_ctx *cc = tls_copy.lookup(&zero);
    if (!d || !cc)
        return;
    d->kind = TT_KIND_DATA;
    d->pid = tgid;
    d->tid = (u32)id;
    d->fd = s->fd;
    d->conn_id = s->conn_id;
    d->ts_enter = c->ts;
    d->ts_exit = bpf_ktime_get_ns();
    d->ret = n;
    d->syscall = dir == TT_DIR_IN ? TT_SYS_SSL_READ : TT_SYS_SSL_WRITE;
    d->direction = dir;
    d->pad = 0;
    if (dir == TT_DIR_IN)
        d->stream_off = __sync_fetch_and_add(&s->pt_in, n);
    else
        d->stream_off = __sync_fetch_and_add(&s->pt_out, n);

    u64 limit = config_get(TT_CFG_CAPTURE_LIMIT, 256 * 1024);
    u64 want = n < limit ? n : limit;
    u8 trunc = want < n ? TT_FLAG_TRUNCATED : 0;
    if (trunc)
        count(TT_CNT_TRUNCATED);
    cc->want = want;
    cc->trunc = trunc | TT_FLAG_TLS;
    cc->base = c->buf;
    cc->left = n;
    cc->iov = 0;
    cc->iovcnt = 0;
    copy_out(cc, d, TT_FLAG_TLS);
}

/* The return of every probed SSL call (one handler: the call's op says what it was). */
int tt_tls_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct tls_call *cp = tls_calls.lookup(&id);
    if (!cp)
        return 0;
    if (cp->depth) {
        cp->depth--;
        return 0;
    }
    struct tls_call c = *cp;
    tls_calls.delete(&id);
    int ret = (int)PT_REGS_RC(ctx);
    struct tls_key k = {.tgid = id >> 32, .ptr = c.ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (!s)
        return 0;
    if (c.op == TLS_OP_HANDSHAKE) {
        if (ret == 1)
            tls_established(id, c.ssl, s);
        else
            tls_started(s);
        return 0;
    }
    u64 n = 0;
    if (c.op & TLS_OP_EX) {
        if (ret == 1 && c.out)
            bpf_probe_read_user(&n, sizeof(n), (void *)c.out);
    } else if (ret > 0) {
        n = ret;
    }
    if (n == 0) {
        tls_started(s);
        return 0;
    }
    tls_established(id, c.ssl, s);
    tls_data(id, &c, s, n);
    return 0;
}

/* SSL_set_fd(ssl, fd): a new object (or one reused) on a named socket. */
int tt_tls_set_fd(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
    u64 ssl = PT_REGS_PARM1(ctx);
    s32 fd = (s32)PT_REGS_PARM2(ctx);
    struct tls_key k = {.tgid = tgid, .ptr = ssl};
    struct tls_ssl fresh = {.fd = -1, .flags = TT_TLS_F_FRESH};
    if (tls_ssls.update(&k, &fresh) != 0) {
        tls_count(TT_TLS_CNT_STATE_FULL, 1);
        return 0;
    }
    struct tls_ssl *s = tls_ssls.lookup(&k);
    u64 key = conn_key(tgid, fd);
    struct conn_state *st = conns.lookup(&key);
    if (s && st)
        tls_bind(id, ssl, s, fd, st->conn_id, TT_TLS_VIA_SET_FD);
    return 0;
}

/* SSL_set_bio(ssl, rbio, wbio): a new object on BIOs of the application's (memory BIOs);
 * its read BIO is remembered. SSL_set_fd calls it too, after its own probe tied the
 * object: that is kept. */
int tt_tls_set_bio(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
    u64 ssl = PT_REGS_PARM1(ctx);
    struct tls_key bk = {.tgid = tgid, .ptr = PT_REGS_PARM2(ctx)};
    if (bk.ptr && tls_rbios.update(&bk, &ssl) != 0)
        tls_count(TT_TLS_CNT_STATE_FULL, 1);
    struct tls_key k = {.tgid = tgid, .ptr = ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (s && (s->flags & TT_TLS_F_FRESH) && !s->pt_in && !s->pt_out) {
        s->rbio = bk.ptr;
        return 0;
    }
    struct tls_ssl fresh = {.fd = -1, .flags = TT_TLS_F_FRESH, .rbio = bk.ptr};
    if (tls_ssls.update(&k, &fresh) != 0)
        tls_count(TT_TLS_CNT_STATE_FULL, 1);
    return 0;
}

/* SSL_free(ssl): forget it; a handshake begun and never completed failed. */
int tt_tls_free(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
    u64 ssl = PT_REGS_PARM1(ctx);
    struct tls_key k = {.tgid = tgid, .ptr = ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (!s)
        return 0;
    if ((s->flags & TLS_S_STARTED) && !(s->flags & TT_TLS_F_ESTABLISHED))
        s->flags |= TT_TLS_F_FAILED;
    if (s->conn_id)
        tls_record(id, ssl, s, TT_TLS_FREE, 0);
    else if (s->flags & TT_TLS_F_FAILED)
        tls_count(TT_TLS_CNT_FAILED_UNBOUND, 1);
    if (s->rbio) {
        struct tls_key bk = {.tgid = tgid, .ptr = s->rbio};
        u64 *owner = tls_rbios.lookup(&bk);
        if (owner && *owner == ssl)
            tls_rbios.delete(&bk);
    }
    tls_ssls.delete(&k);
    return 0;
}

/* ---- BIOs (libcrypto): memory BIOs tied to their sockets ------------------------- */

/* The first TT_TLS_HEAD bytes at ``p`` of ``len`` (fewer: the rest stays zero). */
static __always_inline long tls_read_head(u8 *head, u64 p, long len)
{
    if (len >= TT_TLS_HEAD)
        return bpf_probe_read_user(head, TT_TLS_HEAD, (void *)p);
    return bpf_probe_read_user(head, (u32)len & (TT_TLS_HEAD - 1), (void *)p);
}

static __always_inline int tls_is_record(const u8 *h)
{
    /* content type change_cipher_spec..heartbeat, protocol major version 3 */
    return h[0] >= 20 && h[0] <= 24 && h[1] == 3 && h[2] <= 4;
}

/* BIO_write(bio, data, len) / BIO_write_ex(bio, data, dlen, written) */
int tt_tls_bio_write(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_traced(tgid))
        return 0;
    u64 bio = PT_REGS_PARM1(ctx);
    u64 data = PT_REGS_PARM2(ctx);
    s32 len = (s32)PT_REGS_PARM3(ctx); /* an int for BIO_write: its high half is junk */
    if (len <= 0)
        return 0;
    struct tls_call *c = tls_calls.lookup(&id);
    if (c) {
        /* inside an SSL call: a record of that object, going to its write BIO */
        struct tls_key k = {.tgid = tgid, .ptr = c->ssl};
        struct tls_ssl *s = tls_ssls.lookup(&k);
        if (!s || s->conn_id || len < TT_TLS_HEAD)
            return 0;
        struct tls_head_key hk = {.tgid = tgid};
        if (bpf_probe_read_user(hk.head, TT_TLS_HEAD, (void *)data) != 0 || !tls_is_record(hk.head))
            return 0;
        struct tls_head v = {.ssl = c->ssl, .ts = bpf_ktime_get_ns()};
        if (tls_egress.update(&hk, &v) != 0)
            tls_count(TT_TLS_CNT_STATE_FULL, 1);
        return 0;
    }
    /* outside SSL calls: the application feeding what it received into a read BIO */
    struct tls_in *in = tls_last_in.lookup(&id);
    if (!in)
        return 0;
    struct tls_key bk = {.tgid = tgid, .ptr = bio};
    u64 *owner = tls_rbios.lookup(&bk);
    u64 ssl = owner ? *owner : 0;
    if (in->len != (u32)len) {
        tls_last_in.delete(&id);
        return 0;
    }
    u8 head[TT_TLS_HEAD] = {};
    if (tls_read_head(head, data, len) != 0)
        return 0;
    u64 a0, a1, b0, b1;
    __builtin_memcpy(&a0, head, 8);
    __builtin_memcpy(&a1, head + 8, 8);
    __builtin_memcpy(&b0, in->head, 8);
    __builtin_memcpy(&b1, in->head + 8, 8);
    struct tls_in got = *in;
    tls_last_in.delete(&id);
    if (a0 != b0 || a1 != b1)
        return 0;
    if (!ssl) {
        /* a read BIO of an object set up before attach: its BIO_read will say whose */
        struct tls_bio b = {.conn_id = got.conn_id, .fd = got.fd};
        if (tls_bios.update(&bk, &b) != 0)
            tls_count(TT_TLS_CNT_STATE_FULL, 1);
        return 0;
    }
    struct tls_key k = {.tgid = tgid, .ptr = ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (!s || s->conn_id)
        return 0;
    u64 key = conn_key(tgid, got.fd);
    struct conn_state *st = conns.lookup(&key);
    if (st && st->conn_id == got.conn_id)
        tls_bind(id, ssl, s, got.fd, got.conn_id, TT_TLS_VIA_BIO_IN);
    return 0;
}

/* BIO_read(bio, ...) / BIO_read_ex(bio, ...) inside an SSL call: ``bio`` is that
 * object's read BIO; if its socket is known, so is the object's. */
int tt_tls_bio_read(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    struct tls_call *c = tls_calls.lookup(&id);
    if (!c)
        return 0;
    struct tls_key k = {.tgid = tgid, .ptr = c->ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (!s || s->conn_id)
        return 0;
    struct tls_key bk = {.tgid = tgid, .ptr = PT_REGS_PARM1(ctx)};
    struct tls_bio *b = tls_bios.lookup(&bk);
    if (!b)
        return 0;
    u64 key = conn_key(tgid, b->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st || st->conn_id != b->conn_id)
        return 0; /* that socket closed since */
    tls_bind(id, c->ssl, s, b->fd, b->conn_id, TT_TLS_VIA_BIO_IN);
    return 0;
}

/* ---- called by sockets.c --------------------------------------------------------- */

/* A socket syscall's entry: inside an SSL call, the object's socket (socket BIOs). */
static __always_inline void tls_io_enter(u64 id, s32 fd, u64 conn_id)
{
    struct tls_call *c = tls_calls.lookup(&id);
    if (!c)
        return;
    struct tls_key k = {.tgid = id >> 32, .ptr = c->ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (s)
        tls_bind(id, c->ssl, s, fd, conn_id, TT_TLS_VIA_SYSCALL);
}

/* The first TT_TLS_HEAD bytes a syscall moved (zero-padded). */
static __always_inline void tls_head_of(struct io_args *a, long ret, u8 *head)
{
    u64 base = a->buf;
    if (a->shape == SHAPE_IOV) {
        if (!a->iovcnt || bpf_probe_read_user(&base, sizeof(base), (void *)a->buf) != 0)
            return;
    }
    tls_read_head(head, base, ret);
}

/*
 * A socket syscall's exit that moved ``ret`` > 0 bytes. Returns 1 when it is the
 * ciphertext of an established TLS object: sockets.c then sends it without payload.
 * Outside SSL calls it remembers a read for tt_tls_bio_write(), and ties a memory-BIO
 * object to the socket whose send starts with one of its records.
 */
static __always_inline int tls_io_exit(u64 id, struct io_args *a, long ret)
{
    u32 tgid = id >> 32;
    if (!tls_procs.lookup(&tgid))
        return 0; /* this process never made an SSL call */
    u64 key = conn_key(tgid, a->fd);
    struct tls_sock *ts = tls_socks.lookup(&key);
    if (ts && ts->conn_id == a->conn_id && ts->established)
        return 1;
    if (tls_calls.lookup(&id))
        return 0; /* a socket BIO's own syscall: tied at its entry */
    if (a->direction == TT_DIR_IN) {
        struct tls_in in = {.conn_id = a->conn_id, .fd = a->fd,
                            .len = ret > 0xffffffffL ? 0xffffffffU : (u32)ret};
        tls_head_of(a, ret, in.head);
        tls_last_in.update(&id, &in);
        return 0;
    }
    if (ret < TT_TLS_HEAD)
        return 0;
    struct tls_head_key hk = {.tgid = tgid};
    tls_head_of(a, ret, hk.head);
    if (!tls_is_record(hk.head))
        return 0;
    struct tls_head *v = tls_egress.lookup(&hk);
    if (!v)
        return 0;
    u64 ssl = v->ssl;
    u64 age = bpf_ktime_get_ns() - v->ts;
    tls_egress.delete(&hk);
    if (age > TLS_EGRESS_MAX_NS)
        return 0;
    struct tls_key k = {.tgid = tgid, .ptr = ssl};
    struct tls_ssl *s = tls_ssls.lookup(&k);
    if (s && !s->conn_id)
        tls_bind(id, ssl, s, a->fd, a->conn_id, TT_TLS_VIA_BIO_OUT);
    return 0;
}
