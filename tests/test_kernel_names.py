"""Kernel names in the GPU ledger: a name seen live by the driver's probes beats one
symbolised from a host stub, whichever comes first; the summary says where each
launched handle's name came from; a host-stub name survives a capture round trip."""

from __future__ import annotations

from tracer.correlate.gpu import GpuLedger
from tracer.events import capture, schema, wire
from tracer.events.gpu import KernelBurst, KernelName, KernelStub

C = wire.CONSTANTS
LIVE, STUB = C["NAME_MODULE_GET_FUNCTION"], C["NAME_HOST_STUB"]


def _name(handle: int, name: str, source: int, alias_of: int = 0) -> KernelName:
    return KernelName(pid=1, tid=2, ts=3, source=source, handle=handle, alias_of=alias_of,
                      name=name)


def _burst(counts: dict[int, int]) -> KernelBurst:
    return KernelBurst(pid=1, tid=2, reason="sync", sync_api=0, first_ts=1, last_ts=2,
                       launches=sum(counts.values()), graph_launches=0, copy_bytes={},
                       copy_calls={}, memset_bytes=0, memset_calls=0, sync_calls=1,
                       sync_wait_ns=0, query_polls=0, handle_counts=counts)


def test_live_names_win_whichever_comes_first():
    led = GpuLedger()
    for ev in (_name(0xA, "_Z4liveA", LIVE), _name(0xA, "_Z4stubA", STUB),  # live first
               _name(0xB, "_Z4stubB", STUB), _name(0xB, "_Z4liveB", LIVE),  # stub first
               _name(0xC, "_Z4stubC", STUB),
               _name(0xD, "", C["NAME_KERNEL_GET_FUNCTION"], alias_of=0xB),
               KernelStub(pid=1, tid=2, ts=3, handle=0xC, stub=0x1000),
               _burst({0xA: 5, 0xB: 4, 0xC: 3, 0xD: 2, 0xE: 1})):
        led.handle(ev)
    p = led.processes[1]
    assert p.names == {0xA: "_Z4liveA", 0xB: "_Z4liveB", 0xC: "_Z4stubC", 0xD: "_Z4liveB"}
    (proc,) = led.summary()["processes"]
    none = {"handles": 0, "launches": 0}
    assert proc["kernel_names"] == {"live": {"handles": 3, "launches": 11},
                                    "host_stub": {"handles": 1, "launches": 3},
                                    "registered_stub": none, "stub_slot": none,
                                    "driver_object": none, "driver_string": none,
                                    "unknown": {"handles": 1, "launches": 1},
                                    "host_stubs_seen": 1, "name_records": 6}
    assert {k["name"]: k["launches"] for k in proc["top_kernels"]} == {
        "_Z4liveA": 5, "_Z4liveB": 6, "_Z4stubC": 3, "unknown@0xe": 1}


def test_host_stub_name_is_a_user_event_in_captures(tmp_path):
    """Symbolised in user space, the full name goes into the capture as JSON (no
    128-byte cut as in the KNAME record) and replays as the same KernelName."""
    long_name = "_ZN2at6native" + "x" * 300
    ev = _name(0xC, long_name, STUB)
    path = tmp_path / "c.ttcap"
    w = capture.CaptureWriter(path)
    w.write(wire.KSTUB.pack(pid=1, tid=2, ts=3, handle=0xC, stub=0x1000))
    w.write(ev)
    w.close()
    items = list(capture.CaptureReader(path))
    assert isinstance(schema.decode(items[0]), KernelStub)
    assert items[1] == ev


def test_a_runtime_given_the_kernel_handle_itself_is_counted_not_symbolised():
    """PyTorch 2.11 + CUDA 13 on an H100: cudaLaunchKernel's "func" was the driver's
    kernel handle (the same value cuLaunchKernel got), not a host-stub address. Such a
    stub is never looked up in the process's mappings, and is counted by that reason;
    it is no unnamed stub in the drop report (it is named, or not, from the process's
    memory: tracer/probes/prenames.py)."""
    import os
    import threading

    from tracer.probes.stubnames import StubNames

    names = StubNames(None, {}, threading.Lock())
    names.on_stub(KernelStub(pid=os.getpid(), tid=1, ts=1, handle=0x30B91240, stub=0x30B91240))
    assert names.resolve() == []
    assert names.unresolved == {"kernel_handle": 1}
    assert "kernel handle" in names.unresolved_examples["kernel_handle"]
    assert names.counters() == {"stub_unresolved": 0}
