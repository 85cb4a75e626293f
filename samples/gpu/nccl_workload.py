"""Two tensor-parallel-style ranks on two GPUs doing NCCL all-reduces through
torch.distributed. Prints "ready", waits for a line on stdin (so a tracer can attach to
this parent, whose children it then follows), spawns the ranks and prints one JSON line
with what each rank did."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, ELEMS = 100, 1 << 20


def rank(r: int, n: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", rank=r, world_size=n)
    x = torch.ones(ELEMS, dtype=torch.float16, device=f"cuda:{r}")
    for _ in range(STEPS):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    print("ready", flush=True)
    sys.stdin.readline()
    mp.spawn(rank, args=(2,), nprocs=2)
    print(json.dumps({"ranks": 2, "allreduce_per_rank": STEPS,
                      "bytes_per_allreduce": ELEMS * 2}), flush=True)
