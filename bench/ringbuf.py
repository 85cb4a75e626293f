"""What reading the events ring buffer costs the agent per record: BCC's callback
(``ctypes`` per record, then ``string_at``) against the ring mapped and read in place
(``tracer.probes.ringbuf.RingReader``), on the same real BPF ring in one run.

    python bench/ringbuf.py [--records 400000] [--batch 2000] [--rounds 5] [--cpu 1]
        [--out bench/results/ringbuf.json]

A tracepoint program (``PROGRAM``, also the tests') sends numbered records of 8-400
bytes (~200 on average, a token write's DATA record is ~150-300) for each getppid()
of this process; the bench makes ``--batch`` calls, then times (CPU) one read of
what they sent, ``--records`` in all per reader and round, readers alternating; the
best round of each is reported, with their ratio per round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROGRAM = r"""
BPF_RINGBUF_OUTPUT(events, RING_PAGES);
BPF_ARRAY(seq, u64, 1);
BPF_ARRAY(full, u64, 1);
BPF_ARRAY(discarded, u64, 1);
struct blob { u8 b[512]; };
BPF_PERCPU_ARRAY(scratch, struct blob, 1);

static void count(void *map_lookup_result) {
    if (map_lookup_result)
        __sync_fetch_and_add((u64 *)map_lookup_result, 1);
}

TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if ((bpf_get_current_pid_tgid() >> 32) != TARGET)
        return 0;
    int zero = 0;
    u64 *s = seq.lookup(&zero);
    struct blob *blob = scratch.lookup(&zero);
    if (!s || !blob)
        return 0;
    u64 n = __sync_fetch_and_add(s, 1);
    if (n % 7 == 3) {  /* reserved, then given back: the reader skips it */
        u8 *r = events.ringbuf_reserve(400);
        if (!r) {
            count(full.lookup(&zero));
            return 0;
        }
        events.ringbuf_discard(r, 0);
        count(discarded.lookup(&zero));
        return 0;
    }
    *(u64 *)blob->b = n;
    for (int i = 8; i < 400; i++)  /* bounded: the record's own pattern */
        blob->b[i] = (u8)(n + i);
    /* sizes 8..400 bytes, most not multiples of 8: the reader rounds them up */
    u64 size = 8 + (n * 37) % 393;
    asm volatile("%0 &= 0x1ff" : "+r"(size));  /* a bound the verifier sees (clang drops a C one) */
    if (events.ringbuf_output(blob, size, BPF_RB_NO_WAKEUP) != 0)
        count(full.lookup(&zero));
    return 0;
}
"""


def one_round(reader, got: list[int], records: int, batch: int) -> float:
    """CPU seconds per record for ``reader`` to read ``records`` records, ``batch``
    at a time (``got[0]``: the records its handler saw)."""
    got[0] = 0
    spent = 0.0
    for _ in range(records // batch):
        for _ in range(batch):
            os.getppid()
        t0 = time.process_time()
        reader.consume()
        spent += time.process_time() - t0
    return spent / max(1, got[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench/results/ringbuf.json"))
    args = ap.parse_args(argv)
    from tracer.probes import loader, ringbuf
    os.sched_setaffinity(0, {args.cpu})
    loader.check_environment()
    bcc = loader.import_bcc()
    b = bcc.BPF(text=PROGRAM, cflags=[f"-DTARGET={os.getpid()}", "-DRING_PAGES=4096"])
    got = [0]

    def on_record(buf: bytes) -> None:
        got[0] += 1

    # one reader of each kind on the same ring (BCC opens a ring once), used in turn
    bcc_reader = ringbuf.BccReader(b, b[b"events"], on_record)
    mapped_reader = ringbuf.RingReader(b[b"events"].map_fd, b[b"events"].max_entries,
                                       on_record)
    mapped, callback = [], []
    for _ in range(args.rounds):
        mapped.append(one_round(mapped_reader, got, args.records, args.batch))
        callback.append(one_round(bcc_reader, got, args.records, args.batch))
    mapped_reader.close()
    full = int(b[b"full"][0].value)
    b.cleanup()
    out = {"machine": platform.machine(), "python": platform.python_version(),
           "cpu": args.cpu, "records_per_round": args.records, "batch": args.batch,
           "lost_for_room": full,
           "bcc_callback_us_per_record": round(min(callback) * 1e6, 3),
           "mapped_us_per_record": round(min(mapped) * 1e6, 3),
           "ratio_per_round": [round(m / c, 3) for m, c in zip(mapped, callback)]}
    print(json.dumps(out, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
