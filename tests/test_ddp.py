"""DistributedDataParallel (gloo, 2 CPU processes): parity with one process on the global batch.

Usage pattern: ``DDP(capskip_fx.compile(model))``.  Dynamo's DDPOptimizer splits the graph per
bucket; the head's split selects, the others reuse its rows (capskip::shared).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.rules import CAPSkip
from helpers.distributed import PG_TIMEOUT, finish, free_port, spawn
from helpers.torch_features import needs_batch_marking

pytestmark = pytest.mark.subprocess  # starts Python processes

W, N = 2, 6
KEEP = [torch.tensor([0, 3]), torch.tensor([1, 2, 5])]


def make_model():
    torch.manual_seed(0)
    # > 1 MB of float64 parameters per Linear so that bucket_cap_mb=1 splits the graph
    return nn.Sequential(nn.Linear(6, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 3)).double()


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(W * N, 6, generator=g, dtype=torch.float64)
    m = make_model()
    with torch.no_grad():
        y = m(x).argmax(1)  # correct rows, so CAPSkip has candidates
    y[::4] = (y[::4] + 1) % 3
    return x, y


def _worker(rank, port, path, optimize_ddp, scope, accumulate):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=PG_TIMEOUT)
    torch.set_num_threads(1)
    torch._dynamo.config.optimize_ddp = optimize_ddp
    model = make_model()
    rule = CAPSkip(budget=0.5) if scope == "global" else "forced"
    opts = {} if scope == "global" else {"keep": lambda n: KEEP[rank]}
    cm = capskip_fx.compile(model, rule=rule, backend="aot_eager", scope=scope, **opts)
    ddp = nn.parallel.DistributedDataParallel(cm, bucket_cap_mb=1)
    x, y = make_data()
    sl = slice(rank * N, (rank + 1) * N)
    if accumulate:  # a first micro-batch under no_sync (local accumulation), then the synced one
        with ddp.no_sync():
            F.cross_entropy(ddp(x[sl].flip(0).clone()), y[sl].flip(0)).backward()
    F.cross_entropy(ddp(x[sl].clone()), y[sl]).backward()
    weights = [torch.empty(N, dtype=torch.float64) for _ in range(W)]
    dist.all_gather(weights, capskip_fx.stats(cm).weight)
    if rank == 0:
        torch.save({"grads": {k: p.grad for k, p in model.named_parameters()}, "report": capskip_fx.report(cm),
                    "weight": torch.cat(weights)}, path)
    finish(path, rank)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("optimize_ddp,scope,accumulate", [(True, "per_rank", False), (False, "per_rank", False),
                                                            (True, "global", False), (True, "per_rank", True)])
def test_ddp_matches_single_process(tmp_path, optimize_ddp, scope, accumulate):
    path = str(tmp_path / "out.pt")
    spawn(_worker, (free_port(), path, optimize_ddp, scope, accumulate), W, path)
    out = torch.load(path, weights_only=False)
    x, y = make_data()
    w = out["weight"]
    if scope == "per_rank":
        expect = torch.zeros(W * N, dtype=torch.float64)
        expect[KEEP[0]] = 1
        expect[N + KEEP[1]] = 1
        assert torch.equal(w, expect), (
            f"each rank must weight exactly its forced KEEP rows (1) and zero the rest; gathered weights {w.tolist()}")
    else:  # the same decision as one process running CAPSkip on the global batch
        single = capskip_fx.compile(make_model(), rule=CAPSkip(budget=0.5), backend="eager")
        F.cross_entropy(single(x), y).backward()
        assert torch.equal(w, capskip_fx.stats(single).weight), (
            "scope='global' under DDP must select the rows one process running CAPSkip on the global batch selects;"
            f" DDP weights {w.tolist()} vs single-process {capskip_fx.stats(single).weight.tolist()}")
        assert 0 < int((w == 0).sum()) < W * N, (
            "the global selection must drop some rows but not all, or the parity check proves nothing;"
            f" {int((w == 0).sum())} of {W * N} dropped")
    ref = make_model()
    (F.cross_entropy(ref(x), y, reduction="none") * w).sum().div(W * N).backward()
    if accumulate:  # each rank's flipped micro-batch selected the same positions of its flipped rows
        flip = torch.cat([torch.arange(r * N, (r + 1) * N).flip(0) for r in range(W)])
        (F.cross_entropy(ref(x[flip]), y[flip], reduction="none") * w).sum().div(W * N).backward()
    for k, p in ref.named_parameters():
        assert (out["grads"][k] - p.grad).norm() <= 1e-10 * p.grad.norm(), k
    roles = [r["role"] for r in out["report"]]
    assert roles.count("head") == 1, (
        f"exactly one graph (the logits') must be the head that selects, the DDP splits reuse its rows; roles {roles}")
    assert all(r["backward"] == "selected rows" for r in out["report"]), (
        f"every graph, each DDP bucket split too, must run its backward on the selected rows; {out['report']}")
    if optimize_ddp:
        assert len(roles) >= 2, (
            f"DDPOptimizer must split the graph per bucket (bucket_cap_mb=1); got {len(roles)} graph(s)")  # DDPOptimizer split the graph; the body splits dropped rows too


def _fsdp_worker(rank, port, path):
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=PG_TIMEOUT)
    out = {}
    model = make_model()
    fully_shard(model[2])
    fully_shard(model)
    try:
        capskip_fx.compile(model, backend="aot_eager")
    except NotImplementedError as e:
        out["refused"] = str(e)
    # sharded after compiling: can't be seen at compile(); the step says it ran dense
    model = make_model()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    fully_shard(model[2])
    fully_shard(cm)
    x, y = make_data()
    F.cross_entropy(cm(x), y).backward()
    out["fallback"] = capskip_fx.stats(cm).fallback
    out["kept"] = capskip_fx.stats(cm).kept
    torch.save(out, path)
    finish(path, rank)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fsdp2_is_refused_clearly(tmp_path):
    path = str(tmp_path / "fsdp.pt")
    spawn(_fsdp_worker, (free_port(), path), 1, path)
    out = torch.load(path, weights_only=False)
    assert "FSDP2" in out["refused"], (
        f"compiling an FSDP2-sharded model must refuse and name FSDP2; got {out['refused']!r}")
    assert "capskip_fx.compile_regions" in out["refused"], (
        f"the FSDP2 refusal must name regional compile, which supports FSDP2; got {out['refused']!r}")
    assert "DDP(capskip_fx.compile(model))" in out["refused"], (
        f"the FSDP2 refusal must point to the supported pattern DDP(capskip_fx.compile(model)); got {out['refused']!r}")
    assert "no graph" in out["fallback"], (
        "a model sharded after compile() must say its step ran dense because no graph was captured;"
        f" fallback {out['fallback']!r}")
    assert out["kept"] == W * N, f"the dense FSDP2 step must keep every row; stats say kept {out['kept']} of {W * N}"


def _nested_worker(rank, port, path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=PG_TIMEOUT)
    inner = torch.compile(make_model(), backend="capskip",
                          options={"rule": "forced", "keep": 0.5, "backend": "aot_eager", "verify": False})
    capskip_fx.mark_compiled_batches(inner)
    outer = torch.compile(DDP(inner), backend="aot_eager")
    x, y = make_data()
    kept = []
    for _ in range(2):
        F.cross_entropy(outer(x), y).backward()
        kept.append(capskip_fx.stats(inner).kept)
    torch.save({"kept": kept}, path)
    finish(path, rank)


@needs_batch_marking  # mark_compiled_batches marks nothing on 2.11: its static batch runs dense
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_a_compiled_ddp_of_a_string_backend_module_selects(tmp_path):
    """``torch.compile(DDP(torch.compile(m, backend="capskip")))``: the outer compile steps around the inner
    wrapper's batch marking (it traced it and failed: ``maybe_mark_dynamic`` is a forbidden callable), and the
    inner graphs select."""
    path = str(tmp_path / "nested.pt")
    spawn(_nested_worker, (free_port(), path), 1, path)
    out = torch.load(path, weights_only=False)
    assert out["kept"] == [W * N // 2] * 2, f"every step should keep half the rows: {out['kept']}"
