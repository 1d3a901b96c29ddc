"""Data parallel with one process on NCCL (CUDA) or gloo (CPU): ``DDP(capskip_fx.compile(model))``
(``--engine ddp``), DDP over a regionally compiled model (``ddp-regional``) or FSDP2 with ``fully_shard``
per block and the blocks and head compiled in place (``fsdp2-regional``, torchtitan's recipe).  Checks
that the step's gradients are the average of ``sum_kept w_i grad l_i / N`` (against an eager float32
reference built from the step's weights) and that every graph, DDPOptimizer's bucket splits included,
ran on the kept rows.  Prints one JSON line; exit status 1 on a mismatch.

    python benchmarks/ddp_check.py [--device cuda] [--engine ddp|ddp-regional|fsdp2-regional]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import capskip_fx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--engine", default="ddp", choices=["ddp", "ddp-regional", "fsdp2-regional"])
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                                  num_classes=10, depth=a.depth).to(dev)
        ref = copy.deepcopy(model)
        if a.engine == "ddp":
            cm = capskip_fx.compile(model, rule="forced", keep=0.5)
            ddp = DDP(cm, bucket_cap_mb=1)  # small buckets: DDPOptimizer splits the graph
        else:
            if a.engine == "fsdp2-regional":
                from torch.distributed.fsdp import fully_shard
                for b in model.blocks:
                    fully_shard(b)
            cm = capskip_fx.compile_regions(model, rule="forced", keep=0.5)
            ddp = fully_shard(model) if a.engine == "fsdp2-regional" else DDP(model)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 3, 32, 32, generator=g).to(dev), torch.randint(0, 10, (32,), generator=g).to(dev)
        errs = []
        for _ in range(3):
            ddp.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            w = capskip_fx.stats(cm).weight
            ref.zero_grad(set_to_none=True)
            (F.cross_entropy(ref(x), y, reduction="none") * w).mean().backward()
            errs.append(max(float((_full(p.grad) - q.grad).norm() / q.grad.norm().clamp_min(1e-30))
                            for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None))
        report = capskip_fx.report(cm)
        out = {"backend": backend, "engine": a.engine, "torch": torch.__version__, "graphs": len(report),
               "selected": [r["backward"] for r in report], "kept": capskip_fx.stats(cm).kept, "n": 32,
               "max_rel_err": max(errs)}
        ok = out["max_rel_err"] < 1e-4 and all(r == "selected rows" for r in out["selected"]) and out["kept"] == 16
        out["ok"] = ok
        print(json.dumps(out))
    finally:
        dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's sharded DTensor gradients


if __name__ == "__main__":
    main()
