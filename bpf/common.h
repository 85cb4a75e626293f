/*
 * Shared by every tokentrace BPF concern: which processes are traced, loss counters,
 * run-time settings and the ring buffer. The loader prepends the generated wire
 * definitions (tracer/events/wire.py) and then concatenates the enabled concerns into
 * one program, so all of them share these maps.
 */
#include <uapi/linux/ptrace.h>

/*
 * The user-memory read helpers, called by names BCC does not check. BCC checks every
 * call of bpf_probe_read_user(_str) by that name against the kernel's symbols, and
 * each check rebuilds its table of every kernel symbol (kallsyms has names twice, so
 * the table never looks complete): ~60 ms a call site with 122k symbols, 2.5 s of
 * compiling all the concerns' 43 call sites (bench/compile_time.py). The helpers are
 * in every kernel these probes load on (Linux 5.5; the ring buffer needs 5.8).
 */
static int (*tt_read_user)(void *dst, __u32 size, const void *unsafe_ptr) =
    (void *)BPF_FUNC_probe_read_user;
static int (*tt_read_user_str)(void *dst, __u32 size, const void *unsafe_ptr) =
    (void *)BPF_FUNC_probe_read_user_str;
#define bpf_probe_read_user tt_read_user
#define bpf_probe_read_user_str tt_read_user_str

#ifndef TT_RINGBUF_PAGES
#define TT_RINGBUF_PAGES 8192
#endif

/* tgid -> 1. The pid filter lives here so that untraced processes cost one lookup. */
BPF_HASH(traced, u32, u32, 16384);

/* comm -> 1: processes that exec a program with this name become traced (--comm). */
struct comm_key { char comm[16]; };
BPF_HASH(traced_comms, struct comm_key, u32, 64);

/* Run-time settings written by Python before attaching. */
BPF_ARRAY(config, u64, TT_N_CONFIG);

/* Loss and truncation counters (TT_CNT_*), per CPU so that counting never contends. */
BPF_PERCPU_ARRAY(counters, u64, TT_N_COUNTERS);

BPF_RINGBUF_OUTPUT(events, TT_RINGBUF_PAGES);

static __always_inline void count(u32 which)
{
    u64 *c = counters.lookup(&which);
    if (c)
        (*c)++;
}

/* count() by n; no branch on n (see verbs_post in ibverbs.c for why that matters) */
static __always_inline void count_n(u32 which, u64 n)
{
    u64 *c = counters.lookup(&which);
    if (c)
        *c += n;
}

/*
 * A tracepoint ran `runs` programs for a traced process: its syscall's entry and exit,
 * or a TCP event of its connection. The kernel counts a program's runs in every
 * process alike; the overhead meter (tracer/overhead.py) sets these apart from the
 * rest, which stop at the pid or port filter and cost other processes.
 */
static __always_inline void count_traced_runs(u64 runs)
{
    count_n(TT_CNT_TRACED_TP_RUNS, runs);
}

static __always_inline int is_traced(u32 tgid)
{
    return traced.lookup(&tgid) != NULL;
}

static __always_inline u64 config_get(u32 idx, u64 dflt)
{
    u64 *v = config.lookup(&idx);
    return (v && *v) ? *v : dflt;
}

/* Records submitted on this CPU since the last forced wake-up of the consumer. */
BPF_PERCPU_ARRAY(since_wakeup, u32, 1);
#define TT_WAKEUP_EVERY 64

/*
 * Put a record in the ring: 0, or below 0 where it stayed out, which the caller counts
 * as lost in its own counter (submit() below; tls.c, ibverbs.c and stacks.c count
 * theirs in their own arrays).
 *
 * A refused output is timed. A full ring refuses at once. Since Linux 6.15 the ring's
 * lock is a resilient spinlock that gives up instead of spinning on: 250-500 ms for a
 * holder that does not let go, and (since a series merged for 6.19) at once for a
 * deadlock on its own CPU or where it makes a single attempt.
 * Runs lose a record or a few with the ring nearly empty, and the two such losses
 * timed so far were refused in 300 and 1,332 ns (docs/overhead.md). So a refusal that
 * came back fast is tried once more: it costs a few hundred ns only where a record
 * would be lost, and a record it saves is counted (ring_retry_saved). One that spun is
 * not: the holder may not have let go.
 */
static __always_inline int ring_out(void *rec, u32 size, u64 flags)
{
    u64 t0 = bpf_ktime_get_ns();
    if (events.ringbuf_output(rec, size, flags) == 0)
        return 0;
    u64 spent = bpf_ktime_get_ns() - t0;
    if (spent < TT_RING_SLOW_NS && events.ringbuf_output(rec, size, flags) == 0) {
        count(TT_CNT_RING_RETRY_SAVED);
        count_n(TT_CNT_RING_REFUSED_NS, spent);
        return 0;
    }
    spent = bpf_ktime_get_ns() - t0;
    count_n(TT_CNT_RING_REFUSED_NS, spent);
    if (spent >= TT_RING_SLOW_NS)
        count(TT_CNT_RING_REFUSED_SLOW);
    return -1;
}

/*
 * Submit a record; a record the ring refuses is counted in `lost_counter`, never silent.
 * No wake-up per record: the consumer polls on a short timer and is woken early only
 * every TT_WAKEUP_EVERY records a CPU submits. Waking it for every record cost one
 * epoll cycle per record, half of the tracer's CPU. Timestamps are taken here, so the
 * delay changes when a span is exported, never what it says.
 */
static __always_inline void submit(void *rec, u32 size, u32 lost_counter)
{
    u32 zero = 0;
    u64 flags = BPF_RB_NO_WAKEUP;
    u32 *n = since_wakeup.lookup(&zero);
    if (n && ++(*n) >= TT_WAKEUP_EVERY) {
        *n = 0;
        flags = BPF_RB_FORCE_WAKEUP;
    }
    if (ring_out(rec, size, flags) != 0)
        count(lost_counter);
}
