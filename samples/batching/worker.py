"""An engine rank process of the ``process`` and ``tp2`` layouts (started by
``samples.batching.server``, never by hand).

Rank 0 connects to the API process's unix socket, takes submit messages, runs steps
and sends each step's output back; in tp2 it first accepts rank 1 on a second unix
socket and sends it every step's plan, which rank 1 runs in lockstep (same launches,
same all-reduce). A rank exits when its upstream socket closes; SIGTERM and SIGINT are
ignored so a step is never cut in half and the stand-ins always write their counts.
"""

from __future__ import annotations

import argparse
import select
import signal
import socket
import sys
from typing import Any

import torch

from samples import tinygpt
from samples.batching import wire
from samples.batching.engine import (CpuExecutor, CudaExecutor, Engine, Executor,
                                     Scheduler, write_step)
from samples.batching.gpu import StandinGpu, StandinNccl
from samples.batching.truth import TruthFile


def make_executor(device: str, max_batch: int, libcuda: str | None, nccl: StandinNccl | None,
                  rank: int, world: int) -> Executor:
    """The model on this rank's device and the executor that runs its steps."""
    model, dev = tinygpt.load_model(f"cuda:{rank}" if device == "cuda" else "cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
        return CudaExecutor(model, dev, max_batch, dist=world > 1)
    gpu = StandinGpu(libcuda, max_batch * model.cfg.block) if libcuda else None
    return CpuExecutor(model, gpu, nccl, max_batch)


def make_engine(device: str, max_batch: int, prefill_chunk: int, libcuda: str | None,
                nccl: StandinNccl | None, truth: TruthFile, rank: int = 0, world: int = 1,
                peer: socket.socket | None = None) -> Engine:
    executor = make_executor(device, max_batch, libcuda, nccl, rank, world)
    on_plan = (lambda plan: wire.send(peer, plan)) if peer else None
    return Engine(Scheduler(max_batch, prefill_chunk, tinygpt.GPTConfig().block), executor,
                  truth, rank=rank, on_plan=on_plan)


def serve_rank0(engine: Engine, api: socket.socket) -> None:
    """Take submits, run steps while there is work, send each step's output."""
    frames = wire.FrameReader()
    bad = 0
    while True:
        ready, _, _ = select.select([api], [], [], 0 if engine.scheduler.busy else None)
        if ready:
            data = api.recv(1 << 16)
            if not data:
                return
            for msg in frames.feed(data):
                try:
                    engine.submit(msg)
                except (KeyError, TypeError, ValueError) as e:
                    bad += 1
                    print(f"engine: bad submit message ({bad} so far), skipped: {e!r}",
                          file=sys.stderr, flush=True)
        if engine.scheduler.busy:
            wire.send(api, engine.step())


def serve_rank1(executor: Executor, peer: socket.socket, truth: TruthFile) -> None:
    """Run every plan rank 0 sends, in order, until it closes the socket."""
    while (plan := wire.recv(peer)) is not None:
        _, timing = executor.run(plan)
        write_step(truth, 1, plan, timing)


def _join_peer(rank: int, path: str) -> socket.socket:
    if rank == 0:
        listener = wire.listen(path)
        peer, _ = listener.accept()
        listener.close()
        return peer
    return wire.connect(path)


def _init_collectives(args: argparse.Namespace, peer: socket.socket) -> StandinNccl | None:
    if args.device == "cuda":
        import torch.distributed as tdist
        torch.cuda.set_device(args.rank)
        tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.dist_port}",
                                 rank=args.rank, world_size=args.world,
                                 device_id=torch.device("cuda", args.rank))
        return None
    if not args.libnccl:
        return None
    nccl = StandinNccl(args.libnccl)
    if args.rank == 0:
        uid = nccl.unique_id()
        wire.send(peer, {"nccl_id": uid.hex()})
    else:
        msg: dict[str, Any] | None = wire.recv(peer)
        if msg is None or "nccl_id" not in msg:
            raise RuntimeError("rank 0 closed before sending the NCCL id")
        uid = bytes.fromhex(msg["nccl_id"])
    nccl.init_rank(uid, args.world, args.rank)
    return nccl


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1, choices=(1, 2))
    p.add_argument("--api-socket", required=True)
    p.add_argument("--peer-socket", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--truth")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--libcuda")
    p.add_argument("--libnccl")
    p.add_argument("--dist-port", type=int, default=0)
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(1)
    truth = TruthFile(args.truth)
    peer = _join_peer(args.rank, args.peer_socket) if args.world > 1 else None
    nccl = _init_collectives(args, peer) if peer else None
    engine = make_engine(args.device, args.max_batch, args.prefill_chunk, args.libcuda, nccl,
                         truth, args.rank, args.world, peer if args.rank == 0 else None)
    try:
        if args.rank == 0:
            api = wire.connect(args.api_socket)  # we are ready: the API may serve now
            try:
                serve_rank0(engine, api)
            finally:
                api.close()
        else:
            assert peer is not None
            serve_rank1(engine.executor, peer, truth)
    finally:
        if peer:
            peer.close()
        if args.device == "cuda" and args.world > 1:
            import torch.distributed as tdist
            tdist.destroy_process_group()
        truth.close()


if __name__ == "__main__":
    main()
