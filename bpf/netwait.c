/*
 * When the kernel held a served request's bytes: arrival in the socket before the
 * server read them (listen backlog, receive queue), and departure after the server
 * wrote them (Nagle, cork, congestion or peer window). Syscall probes cannot see
 * either; the client feels both.
 *
 * Only stable tracepoints, read through the formats the running kernel publishes in
 * tracefs (BCC builds TRACEPOINT_PROBE's args from them): no kernel struct is read.
 * Fields used, present from Linux 5.15 to 6.18 (docs/netwait.md):
 *   sock:inet_sock_set_state  sport, dport, protocol, saddr_v6, daddr_v6, old/newstate
 *   tcp:tcp_probe             saddr, daddr (sockaddr_in/_in6), sport, data_len,
 *                             snd_nxt, snd_una, snd_cwnd, snd_wnd
 *   tcp:tcp_rcv_space_adjust  sport, dport, saddr_v6, daddr_v6 (hooked from sockets.c)
 * A socket is keyed by its 4-tuple, the one identity all three give on every version
 * (tcp_probe has no skaddr before 6.x, inet_sock_set_state no cookie).
 *
 * Softirq tracepoints fire for every TCP socket of the host: the first thing each
 * does is look its local port up in `nw_ports` (the traced servers' listening ports,
 * filled by Python), so other traffic pays one lookup. Per-socket state is aggregated
 * here; a record goes out only with news: the first read of each arrival burst
 * (ARRIVAL), the first ACK that finds written bytes still unsent (HOLD), the ACK
 * that shows them gone (DEPARTURE), and an ACK this probe was not run for (UNSEEN).
 * Never one per packet.
 *
 * UNSEEN: the kernel does not run a tracepoint's program while another BPF program
 * (any tool's) is running on that CPU. A softirq that lands inside one (a delayed-ACK
 * timer, on a host whose syscalls run BPF programs) processes its ACK unseen: the
 * ACK that released held bytes can be missed. It shows at the socket's next probe:
 * snd_una past what was sent at the last probe seen means an ACK came between them
 * (an ACK covers only bytes the peer got, sent after that probe). Bytes sent in
 * between left at a time not known; the agent bounds it.
 *
 * Appended after sockets.c (it uses `conns` and struct io_args); sockets.c calls
 * nw_rcv_space() and nw_io_exit() when compiled with TT_NETWAIT.
 */

#define NW_TCP_ESTABLISHED 1
#define NW_TCP_SYN_RECV 3
#define NW_TCP_CLOSE 7
#define NW_IPPROTO_TCP 6
#define NW_MIN_MSS 536 /* RFC 879: no segment is smaller, so cwnd x this bounds in-flight */

struct nw_sock {
    u64 estab_ts;    /* handshake completed (SYN_RECV -> ESTABLISHED); 0: not seen */
    u64 rx_since;    /* arrival of the oldest bytes not yet read; 0: none known */
    u64 rx_bytes;    /* payload bytes that arrived (tcp_probe data_len) */
    u64 rx_read;     /* bytes the owner read */
    u64 rx_last_ts;  /* arrival of the latest data segment */
    u64 rx_last_from;/* rx_bytes before it: where its bytes start in the count */
    u64 tx_end;      /* stream offset after the owner's last written byte */
    u64 tx_end_ts;   /* exit of that write */
    u64 tx_held_ts;  /* last ACK that found written bytes unsent; 0: no hold open */
    u64 tx_held_end; /* stream offset the open hold reaches */
    u64 tx_held_from;/* stream offset of its first unsent byte */
    u64 tx_held_w;   /* exit of the write that ended at tx_held_end */
    u64 conn_id;     /* owner: (pid, fd, conn_id) of the syscall probes */
    u32 pid;
    s32 fd;
    u32 tx_base;     /* TCP sequence number of stream offset 0 (when anchored) */
    u8 anchor_next;  /* fresh socket: its first tcp_probe gives the base */
    u8 anchored;
    u8 rx_reported;  /* the current arrival burst was sent with a read */
    u8 cause;        /* TT_NW_CAUSE_* of the open hold */
    u32 nxt_seen;    /* snd_nxt at the last probe seen (anchored sockets) */
    u64 seen_ts;     /* that probe's time; 0: none yet */
};

/* Listening ports of traced servers (host byte order) -> 1, written by Python. */
BPF_HASH(nw_ports, u16, u32, 1024);
/* LRU: a socket whose close was not seen (or that no traced process owns) ages out
 * instead of filling the map. */
BPF_TABLE("lru_hash", struct nw_key, struct nw_sock, nw_socks, 65536);

static __always_inline int nw_port_traced(u16 port)
{
    return nw_ports.lookup(&port) != NULL;
}

/* tcp_probe stores sockaddr_in (AF_INET sockets) or sockaddr_in6: make the 16-byte
 * form the other tracepoints use. */
static __always_inline void nw_addr_from_sockaddr(u8 *out, const u8 *sa)
{
    u16 family = 0;
    __builtin_memcpy(&family, sa, 2);
    if (family == 2 /* AF_INET */) {
        __builtin_memset(out, 0, 10);
        out[10] = 0xff;
        out[11] = 0xff;
        __builtin_memcpy(out + 12, sa + 4, 4);
    } else {
        __builtin_memcpy(out, sa + 8, 16);
    }
}

static __always_inline void nw_emit(struct nw_sock *s, u16 op, u8 cause, u64 ts, u64 ref_ts,
                                    u64 off, u64 aux, u32 flags)
{
    struct tt_netwait r = {};
    r.kind = TT_KIND_NETWAIT;
    r.pid = s->pid;
    r.tid = (u32)bpf_get_current_pid_tgid();
    r.fd = s->fd;
    r.conn_id = s->conn_id;
    r.op = op;
    r.cause = cause;
    r.flags = flags;
    r.ts = ts;
    r.ref_ts = ref_ts;
    r.stream_off = off;
    r.aux = aux;
    submit(&r, sizeof(r), TT_CNT_LOST_NETWAIT);
}

/* ---- handshake and close ----------------------------------------------------- */

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != NW_IPPROTO_TCP || !nw_port_traced(args->sport))
        return 0;
    count_traced_runs(1);
    struct nw_key k = {};
    __builtin_memcpy(k.laddr, args->saddr_v6, 16);
    __builtin_memcpy(k.raddr, args->daddr_v6, 16);
    k.lport = args->sport;
    k.rport = args->dport;
    if (args->newstate == NW_TCP_CLOSE) {
        nw_socks.delete(&k);
        return 0;
    }
    /* A server's child socket: the final ACK of the handshake arrived. From here the
     * client may send, and the connection waits in the accept queue until accept(). */
    if (args->oldstate == NW_TCP_SYN_RECV && args->newstate == NW_TCP_ESTABLISHED) {
        struct nw_sock s = {};
        s.estab_ts = bpf_ktime_get_ns();
        s.anchor_next = 1;
        s.fd = -1;
        nw_socks.update(&k, &s);
    }
    return 0;
}

/* ---- every segment a traced server's established socket receives ------------- */

/* Why written bytes were not sent when this ACK came, from what tcp_probe gives. */
static __always_inline u8 nw_cause(struct nw_sock *s, u32 snd_nxt, u32 snd_una, u32 cwnd,
                                   u32 snd_wnd)
{
    u32 inflight = snd_nxt - snd_una;
    u32 end_seq = s->tx_base + (u32)s->tx_end;
    if (inflight == 0)
        return TT_NW_CAUSE_CORK; /* nothing to wait for: corked, MSG_MORE or paced */
    if ((s32)(end_seq - (snd_una + snd_wnd)) > 0)
        return TT_NW_CAUSE_RWND; /* beyond the peer's window: the client reads slowly */
    if ((u64)inflight >= (u64)cwnd * NW_MIN_MSS)
        return TT_NW_CAUSE_CWND;
    /* a few small segments in flight and the rest held: Nagle waiting for their ACK
     * (the peer's delayed ACK when it only receives) */
    return TT_NW_CAUSE_NAGLE;
}

TRACEPOINT_PROBE(tcp, tcp_probe)
{
    if (!nw_port_traced(args->sport))
        return 0;
    count_traced_runs(1);
    struct nw_key k = {};
    nw_addr_from_sockaddr(k.laddr, args->saddr);
    nw_addr_from_sockaddr(k.raddr, args->daddr);
    k.lport = args->sport;
    k.rport = args->dport;
    u64 now = bpf_ktime_get_ns();
    struct nw_sock *s = nw_socks.lookup(&k);
    if (!s) {
        /* established before attach, or its port traced since: arrivals only (its
         * stream offsets cannot be tied to sequence numbers) */
        struct nw_sock fresh = {};
        fresh.fd = -1;
        nw_socks.update(&k, &fresh);
        s = nw_socks.lookup(&k);
        if (!s)
            return 0;
    }
    if (args->data_len) {
        if (!s->rx_since) {
            s->rx_since = now;
            s->rx_reported = 0;
        }
        s->rx_last_from = __sync_fetch_and_add(&s->rx_bytes, args->data_len);
        s->rx_last_ts = now;
    }
    u32 snd_nxt = args->snd_nxt, snd_una = args->snd_una;
    if (s->anchor_next) {
        /* The first segment after the handshake: the SYN is acked and nothing the
         * server wrote can be acked before this segment is processed, so snd_una is
         * the sequence number of stream offset 0. */
        s->anchor_next = 0;
        s->anchored = 1;
        s->tx_base = snd_una;
    }
    if (s->anchored) {
        /* Every byte sent since: one the unseen ACK let go may have been acked
         * by a second unseen ACK before this probe (two delayed-ACK timers in a row
         * landing in BPF programs: seen on the busy VM). */
        if (s->seen_ts && s->pid && (s32)(snd_una - s->nxt_seen) > 0) {
            u32 end32 = (u32)s->tx_end;
            u64 from = s->tx_end - (s64)(s32)(end32 - (s->nxt_seen - s->tx_base));
            u64 to = s->tx_end - (s64)(s32)(end32 - (snd_nxt - s->tx_base));
            nw_emit(s, TT_NW_UNSEEN, 0, now, s->seen_ts, to, from, 0);
        }
        s->nxt_seen = snd_nxt;
        s->seen_ts = now;
    }
    if (!s->pid || !s->tx_end_ts)
        return 0;
    if (!s->anchored) {
        /* Opened before attach: anchor at an ACK that finds nothing in flight after
         * the owner's last write returned, when every written byte has been sent
         * (Nagle and windows hold nothing with nothing in flight; a cork could) */
        if (snd_nxt != snd_una || now <= s->tx_end_ts)
            return 0;
        s->tx_base = snd_nxt - (u32)s->tx_end;
        s->anchored = 1;
        return 0;
    }
    u32 sent = snd_nxt - s->tx_base; /* stream offset sent so far, mod 2^32 */
    if (s->tx_held_ts && (s32)(sent - (u32)s->tx_held_end) >= 0) {
        /* Gone. Held bytes leave while an ACK is processed (Nagle, windows), right
         * after this tracepoint: the last ACK that still found them is when they left. */
        nw_emit(s, TT_NW_DEPARTURE, s->cause, s->tx_held_ts, s->tx_held_w, s->tx_held_end,
                s->tx_held_from, 0);
        s->tx_held_ts = 0;
    }
    s32 unsent = (s32)((u32)s->tx_end - sent);
    if (unsent > 0 && now > s->tx_end_ts) {
        /* Written (the write returned before this segment came) and still not sent. */
        if (!s->tx_held_ts) {
            s->cause = nw_cause(s, snd_nxt, snd_una, args->snd_cwnd, args->snd_wnd);
            s->tx_held_from = s->tx_end - (u64)unsent;
            nw_emit(s, TT_NW_HOLD, s->cause, now, s->tx_end_ts, s->tx_end, s->tx_held_from, 0);
        }
        s->tx_held_ts = now;
        s->tx_held_end = s->tx_end;
        s->tx_held_w = s->tx_end_ts;
    }
    return 0;
}

/* ---- hooks called by sockets.c ------------------------------------------------- */

/* tcp_rcv_space_adjust inside a traced read of connection `st`: tie it to its socket. */
static __always_inline void nw_rcv_space(struct conn_state *st, u16 lport, u16 rport,
                                         const u8 *laddr, const u8 *raddr)
{
    if (st->nw_known || !nw_port_traced(lport))
        return;
    __builtin_memcpy(st->nw.laddr, laddr, 16);
    __builtin_memcpy(st->nw.raddr, raddr, 16);
    st->nw.lport = lport;
    st->nw.rport = rport;
    st->nw_known = 1;
}

/* The bytes an iovec array has room for (its first TT_MAX_IOV entries; 0 if one of
 * them cannot be read). */
static __always_inline u64 nw_iov_room(u64 iov, u32 iovcnt)
{
    u64 room = 0;
    for (int i = 0; i < TT_MAX_IOV; i++) {
        if (i >= iovcnt)
            break;
        struct {
            u64 base;
            u64 len;
        } v = {};
        if (bpf_probe_read_user(&v, sizeof(v), (void *)(iov + (u64)i * 16)) != 0)
            return 0;
        room += v.len;
    }
    return room;
}

/* A traced data syscall on a socket returned ret > 0 bytes: `d` is its DATA header. */
static __always_inline void nw_io_exit(struct io_args *a, struct tt_data *d, long ret,
                                       struct conn_state *st)
{
    if (!st->nw_known || st->conn_id != a->conn_id)
        return;
    struct nw_key k = st->nw;
    struct nw_sock *s = nw_socks.lookup(&k);
    if (!s)
        return;
    u32 flags = 0;
    if (s->conn_id != a->conn_id || s->pid != d->pid) {
        /* first syscall of this owner: its first read reports whatever is known */
        s->conn_id = a->conn_id;
        s->pid = d->pid;
        s->fd = a->fd;
        s->rx_reported = 0;
        flags |= TT_NW_FLAG_FIRST;
    }
    if (s->anchored)
        flags |= TT_NW_FLAG_ANCHORED;
    if (a->direction == TT_DIR_OUT) {
        s->tx_end = d->stream_off + (u64)ret;
        s->tx_end_ts = d->ts_exit;
        return;
    }
    u64 before = __sync_fetch_and_add(&s->rx_read, (u64)ret);
    u64 oldest = s->rx_reported ? 0 : s->rx_since;
    if (!s->rx_reported) {
        /* The first read of an arrival burst (or of the owner): when the oldest bytes
         * it returned reached the socket. 0: not seen (arrived before attach, or with
         * the handshake's last segment, which tcp_probe does not see). */
        u64 since = s->rx_since;
        if (since > d->ts_exit)
            since = 0; /* arrived while the read copied: not these bytes */
        nw_emit(s, TT_NW_ARRIVAL, 0, since, d->ts_exit, d->stream_off,
                (flags & TT_NW_FLAG_FIRST) ? s->estab_ts : 0, flags);
        s->rx_reported = 1;
    }
    /* The latest data segment began inside this read, after its first byte, and came
     * later than the burst: its bytes did not wait as long as the oldest. A request
     * read together with bytes sent before it (an HTTP/2 WINDOW_UPDATE or PING that
     * waited unread) starts there; the agent takes this arrival for a request that
     * starts at or after it. One record per such read: single-segment bursts, most
     * of them, send none. */
    u64 from = s->rx_last_from;
    if (from > before && from < before + (u64)ret && s->rx_last_ts > oldest
        && s->rx_last_ts <= d->ts_exit)
        nw_emit(s, TT_NW_LATER, 0, s->rx_last_ts, d->ts_exit, d->stream_off + (from - before),
                0, flags);
    /* Drained: the reader took every byte that arrived, or asked for more than it got
     * (sockets.c keeps a plain read's size in iovcnt; an iovec reader's room is summed
     * only when the byte counts disagree). The next arrival starts a new burst.
     * A TCP read comes back short only with the queue empty, so a short read also
     * resynchronises the counts after a duplicate segment (a tail-loss probe, a
     * spurious retransmission on a busy host) was counted as new bytes: without it the
     * burst would never end, and every later request on the connection would get the
     * first one's arrival. Bytes counted past a short read that came while it ran are
     * taken as real and unread (the copy was done before they came): their burst
     * starts at the latest segment's arrival instead. */
    u64 asked = a->shape == SHAPE_BUF ? a->iovcnt : 0;
    if (s->rx_read < s->rx_bytes && a->shape == SHAPE_IOV)
        asked = nw_iov_room(a->buf, a->iovcnt);
    if (s->rx_read >= s->rx_bytes) {
        s->rx_since = 0;
        s->rx_reported = 0;
        s->rx_read = s->rx_bytes;
    } else if (asked && (u64)ret < asked) {
        if (s->rx_last_ts > a->ts_enter) {
            s->rx_since = s->rx_last_ts;
        } else {
            s->rx_since = 0;
            s->rx_read = s->rx_bytes;
        }
        s->rx_reported = 0;
    }
}
