"""The ring buffer read in place (``tracer.probes.ringbuf``), on a real BPF ring.

A tracepoint program sends numbered records of varying sizes into a one-page ring
(so it wraps every few dozen records), gives some back (discard), and counts those
it found no room for. Every record kept must arrive once, in order, with its bytes,
through the mapped reader as through BCC's own callback.
"""

from __future__ import annotations

import os
import platform

import pytest

from bench.ringbuf import PROGRAM
from tracer.probes import loader, ringbuf


def _loaded(pages: int):
    """The bench's ring program, sending for this process into a ring of ``pages``."""
    loader.check_environment()
    bcc = loader.import_bcc()
    b = bcc.BPF(text=PROGRAM, cflags=[f"-DTARGET={os.getpid()}", f"-DRING_PAGES={pages}"])
    yield b
    b.cleanup()


@pytest.fixture()
def program():
    yield from _loaded(1)


def expected_record(n: int) -> bytes:
    size = 8 + (n * 37) % 393
    return n.to_bytes(8, "little") + bytes((n + i) & 0xFF for i in range(8, size))


def drive(reader, got: list[bytes], rounds: int, per_round: int) -> None:
    for _ in range(rounds):
        for _ in range(per_round):
            os.getppid()
        reader.consume()


def check(got: list[bytes], sent: int) -> None:
    kept = [n for n in range(sent) if n % 7 != 3]
    assert [int.from_bytes(r[:8], "little") for r in got] == kept
    assert all(r == expected_record(int.from_bytes(r[:8], "little")) for r in got)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mapped reader is x86-64's")
def test_mapped_reader_takes_every_record_once_in_order_across_wraps(program):
    got: list[bytes] = []
    reader = ringbuf.open_reader(program, b"events", got.append)
    assert isinstance(reader, ringbuf.RingReader)
    drive(reader, got, rounds=600, per_round=5)  # ~2,000 records kept through a 4 KiB ring
    assert program[b"full"][0].value == 0
    check(got, 3000)
    reader.close()


def ring_bytes(numbers) -> int:
    """What records ``numbers`` take in the ring: each a header and its data rounded
    up to 8 bytes, a given-back one its 400 reserved."""
    return sum(8 + ((400 if n % 7 == 3 else 8 + (n * 37) % 393) + 7) // 8 * 8
               for n in numbers)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mapped reader is x86-64's")
def test_the_reader_says_how_full_the_producer_found_the_ring(program):
    got: list[bytes] = []
    reader = ringbuf.open_reader(program, b"events", got.append)
    for _ in range(10):
        os.getppid()
    reader.consume()
    assert reader.peak == ring_bytes(range(10)) < reader.size
    assert reader.take_peak() == ring_bytes(range(10))
    for _ in range(3):
        os.getppid()
    reader.consume()
    assert reader.take_peak() == ring_bytes(range(10, 13))  # since the last take
    reader.consume()
    assert reader.take_peak() == 0
    assert reader.peak == ring_bytes(range(10))  # the most ever
    check(got, 13)
    reader.close()


@pytest.fixture()
def roomy_program():
    yield from _loaded(64)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mapped reader is x86-64's")
def test_records_sent_during_a_read_count_against_the_position_last_published(roomy_program):
    """The producer sees the consumer position as last published (every
    PUBLISH_EVERY records), not as read so far. 300 records wait; 100 more are sent
    while the 200th is read, 50 while the 300th is: the producer found the first 400
    in the ring at once (all sent before the first publication), then records
    256-449."""
    assert ringbuf.PUBLISH_EVERY == 256
    got: list[bytes] = []

    def read_one(record: bytes) -> None:
        got.append(record)
        for _ in range({200: 100, 300: 50}.get(len(got), 0)):
            os.getppid()

    reader = ringbuf.open_reader(roomy_program, b"events", read_one)
    for _ in range(300):
        os.getppid()
    reader.consume()
    assert roomy_program[b"full"][0].value == 0
    check(got, 450)
    assert ring_bytes(range(400)) > ring_bytes(range(256, 450))
    assert reader.take_peak() == ring_bytes(range(400))
    reader.close()


def test_bcc_reader_reads_the_same(program):
    got: list[bytes] = []
    reader = ringbuf.BccReader(program, program[b"events"], got.append)
    drive(reader, got, rounds=100, per_round=5)
    assert program[b"full"][0].value == 0
    check(got, 500)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mapped reader is x86-64's")
def test_a_full_ring_loses_only_what_the_producer_counted_and_frees_its_room(program):
    got: list[bytes] = []
    reader = ringbuf.open_reader(program, b"events", got.append)
    for _ in range(50):  # far more than a page holds, nothing read meanwhile
        os.getppid()
    reader.consume()
    lost = program[b"full"][0].value
    assert lost > 0 and len(got) > 0
    # the ring held so much that the next record (at most 8 + 400 bytes) had no room
    assert reader.size - 408 < reader.take_peak() <= reader.size
    kept_then = len(got)
    drive(reader, got, rounds=20, per_round=5)  # the room was given back
    assert program[b"full"][0].value == lost
    assert len(got) - kept_then == len([n for n in range(50, 150) if n % 7 != 3])
    numbers = [int.from_bytes(r[:8], "little") for r in got]
    assert numbers == sorted(numbers) and all(r == expected_record(n) for n, r in zip(numbers, got))
    # every record sent is read, given back, or counted as lost: none vanishes
    assert len(got) + program[b"discarded"][0].value + lost == 150
    reader.close()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mapped reader is x86-64's")
def test_a_handler_that_raises_is_counted_and_the_ring_goes_on(program):
    got: list[bytes] = []

    def handler(buf: bytes) -> None:
        if int.from_bytes(buf[:8], "little") % 5 == 0:
            raise RuntimeError("a bug in the handler")
        got.append(buf)

    reader = ringbuf.open_reader(program, b"events", handler)
    drive(reader, got, rounds=40, per_round=5)
    raised = [n for n in range(200) if n % 7 != 3 and n % 5 == 0]
    assert reader.errors == len(raised)
    assert [int.from_bytes(r[:8], "little") for r in got] == \
        [n for n in range(200) if n % 7 != 3 and n % 5 != 0]
    reader.close()


def test_a_size_that_is_no_ring_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        ringbuf.RingReader(-1, 3 * 4096, lambda b: None)


@pytest.fixture()
def big_program():
    yield from _loaded(16)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mapped reader is x86-64's")
def test_a_read_with_a_budget_returns_while_the_producer_keeps_up(big_program):
    """Each record read sends another (as a traced server keeps writing while the agent
    reads): a read without a budget goes on while they come. With one it returns,
    ``behind``, and the reads after it go on in order, losing nothing."""
    import time

    got: list[bytes] = []

    def read_one(record: bytes) -> None:
        got.append(record)
        time.sleep(0.0002)
        if len(got) < 2000:
            os.getppid()  # the next record, sent while this read goes on

    reader = ringbuf.open_reader(big_program, b"events", read_one)
    for _ in range(60):
        os.getppid()
    reader.consume(0.02)
    assert reader.behind and 0 < len(got) < 2000
    reads = 1
    while reader.behind and reads < 1000:
        reader.consume(0.02)
        reads += 1
    assert not reader.behind and reads > 2
    reader.consume()
    assert big_program[b"full"][0].value == 0
    check(got, int.from_bytes(got[-1][:8], "little") + 1)
    reader.close()
