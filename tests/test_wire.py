"""The wire records: one definition, proven identical in C and Python."""

import shutil
import struct
import subprocess

import pytest

from tracer.events import schema, wire

C = wire.CONSTANTS


def test_generated_c_layout_compiles_with_its_own_asserts(tmp_path):
    """gcc checks every offset and size the Python side decodes with."""
    assert shutil.which("gcc"), "gcc is needed to check the wire layout"
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stdint.h>\n"
        "typedef uint8_t u8; typedef uint16_t u16; typedef uint32_t u32; typedef uint64_t u64;\n"
        "typedef int32_t s32; typedef int64_t s64;\n"
        + wire.c_definitions()
        + "int main(void) { return 0; }\n"
    )
    r = subprocess.run(["gcc", "-std=c11", "-fsyntax-only", str(src)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_a_wrong_python_offset_is_caught_by_the_compiler(tmp_path):
    """The asserts are real: a record whose Python layout lies does not compile."""
    text = wire.c_definitions().replace(
        f"__builtin_offsetof(struct tt_data, ts_exit) == {wire.DATA.offsets['ts_exit']}",
        f"__builtin_offsetof(struct tt_data, ts_exit) == {wire.DATA.offsets['ts_exit'] + 8}")
    src = tmp_path / "bad.c"
    src.write_text("#include <stdint.h>\ntypedef uint8_t u8; typedef uint16_t u16; "
                   "typedef uint32_t u32; typedef uint64_t u64; typedef int32_t s32; "
                   "typedef int64_t s64;\n" + text)
    r = subprocess.run(["gcc", "-std=c11", "-fsyntax-only", str(src)], capture_output=True)
    assert r.returncode != 0


def _data_record(payload: bytes, **kw) -> bytes:
    f = dict(kind=C["KIND_DATA"], pid=10, tid=11, fd=5, conn_id=99, ts_enter=1000,
             ts_exit=2000, ret=len(payload), offset=0, len=len(payload),
             syscall=C["SYS_RECVFROM"], direction=C["DIR_IN"], flags=C["FLAG_LAST"], pad=0,
             stream_off=0)
    f.update(kw)
    return wire.DATA.header.pack(*(f[n] for n in wire.DATA.names)) + payload


def test_data_record_decodes_to_typed_event():
    ev = schema.decode(_data_record(b"GET / HTTP/1.1\r\n", stream_off=40))
    assert isinstance(ev, schema.DataEvent)
    assert (ev.pid, ev.tid, ev.fd, ev.conn_id) == (10, 11, 5, 99)
    assert ev.payload == b"GET / HTTP/1.1\r\n"
    assert ev.inbound and ev.last and not ev.truncated
    assert ev.position == 40 and ev.ts == 2000


def test_conn_record_decodes_addresses():
    f = dict(kind=C["KIND_CONN"], pid=1, tid=2, fd=7, ts=5, conn_id=5, ret=0, listen_fd=3,
             op=C["CONN_ACCEPT"], role=C["ROLE_SERVER"], family=2, port=8080,
             addr=bytes([127, 0, 0, 1]) + bytes(12))
    ev = schema.decode(wire.CONN.header.pack(*(f[n] for n in wire.CONN.names)))
    assert ev.peer_addr == "127.0.0.1" and ev.peer_port == 8080 and ev.listen_fd == 3
    f.update(family=10, addr=bytes(10) + b"\xff\xff" + bytes([10, 1, 2, 3]))
    ev = schema.decode(wire.CONN.header.pack(*(f[n] for n in wire.CONN.names)))
    assert ev.peer_addr == "10.1.2.3"  # IPv4-mapped IPv6 shown as IPv4


@pytest.mark.parametrize("bad", [b"", b"\x01\x00", struct.pack("<I", 77) + bytes(60),
                                 struct.pack("<I", C["KIND_DATA"]) + bytes(10)])
def test_malformed_records_raise_wire_error(bad):
    with pytest.raises(schema.WireError):
        schema.decode(bad)


def test_payload_shorter_than_declared_is_an_error():
    rec = _data_record(b"abc", len=10)
    with pytest.raises(schema.WireError):
        schema.decode(rec)


def test_verbs_counter_record_packs_and_decodes_with_names():
    """User space builds VERBS records from the kernel's counter map with pack()."""
    raw = wire.VERBS.pack(pid=7, tid=8, qp_num=0x101, op=C["VERBS_SEND"], opcode=4, ts=5,
                          count=3, bytes=1536, extra=3)
    assert len(raw) == wire.VERBS.size
    ev = schema.decode(raw)
    assert (ev.pid, ev.tid, ev.qp_num, ev.op, ev.opcode) == (7, 8, 0x101, "send", "rdma_read")
    assert (ev.count, ev.bytes, ev.errors, ev.extra) == (3, 1536, 0, 3)
    cqe = schema.decode(wire.VERBS.pack(op=C["VERBS_CQE"], opcode=C["VERBS_OPCODE_ERROR"],
                                        count=1, errors=1))
    assert (cqe.op, cqe.opcode, cqe.errors) == ("cqe", "error", 1)


def test_pack_refuses_unknown_fields_and_array_records():
    with pytest.raises(KeyError, match="no field"):
        wire.VERBS.pack(qpn=1)
    with pytest.raises(TypeError, match="scalar"):
        wire.KBURST.pack(pid=1)


def test_verbs_mr_and_qp_records_decode():
    mr = wire.VERBS_MR.header.pack(C["KIND_VERBS_MR"], 1, 2, C["VERBS_DEREG_MR"], 0, 9,
                                   0xABC, 0x1000, 4096, 5, 6, 1, 0)
    ev = schema.decode(mr)
    assert (ev.op, ev.mr, ev.length, ev.lkey, ev.rkey) == ("dereg", 0xABC, 4096, 5, 6)
    qp = wire.VERBS_QP.header.pack(C["KIND_VERBS_QP"], 1, 2, 0x100, 9, 3, -1, 1, 0)
    ev = schema.decode(qp)
    assert (ev.qp_num, ev.state, ev.dest_qp_num) == (0x100, "rts", -1)


def test_kstub_record_decodes_and_adds_no_layout_change():
    """KSTUB (wire v4) is a new kind; no earlier layout changed (old captures are
    replayed for real in tests/test_old_captures.py)."""
    raw = wire.KSTUB.pack(pid=7, tid=8, ts=5, handle=0xABC0, stub=0x5555_0000_1240)
    assert len(raw) == wire.KSTUB.size == 40
    ev = schema.decode(raw)
    assert (ev.pid, ev.tid, ev.ts, ev.handle, ev.stub) == (7, 8, 5, 0xABC0, 0x5555_0000_1240)
    assert wire.WIRE_VERSION >= 4 and {1, 2, 3, 4} <= set(wire.READABLE_WIRE_VERSIONS)
    assert C["NAME_HOST_STUB"] not in (C["NAME_MODULE_GET_FUNCTION"],
                                       C["NAME_LIBRARY_GET_KERNEL"],
                                       C["NAME_KERNEL_GET_FUNCTION"])
    assert C["CFG_STUB_NAMING"] < C["N_CONFIG"]
