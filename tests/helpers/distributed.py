"""Spawning gloo ranks on CPU with a bounded wait (tests/test_ddp.py, tests/test_fsdp.py)."""
from __future__ import annotations

import datetime
import os
import socket
import time
import warnings

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT = datetime.timedelta(seconds=60)  # a collective that waits longer is a failure


def finish(path, rank):
    """Results are on disk: mark this rank done, then tear down and leave without Python's finalizers.
    torch's gloo teardown can deadlock (~ProcessGroupGloo joining a thread that waits for the GIL, seen on
    2.11 and 2.15 without capskip_fx); the parent then kills a rank that marked itself done."""
    open(f"{path}.done{rank}", "w").close()
    dist.destroy_process_group()
    os._exit(0)


def spawn(fn, args, nprocs, path, limit=300.0, grace=20.0):
    """mp.spawn with a bounded wait: fail fast if a rank has not finished its work within ``limit`` s;
    kill ranks that finished their work but hang in torch's teardown for more than ``grace`` s."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    start, done_at = time.monotonic(), None
    while not ctx.join(timeout=1):
        all_done = all(os.path.exists(f"{path}.done{r}") for r in range(nprocs))
        done_at = done_at or (time.monotonic() if all_done else None)
        if done_at and time.monotonic() - done_at > grace:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            warnings.warn("a worker hung in torch's process-group teardown after its work was done: killed")
            return
        if time.monotonic() - start > limit:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"workers did not finish within {limit:.0f} s (hung in torch.distributed?)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
