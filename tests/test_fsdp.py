"""FSDP2 (``fully_shard`` per block, blocks and head compiled in place: torchtitan's recipe) and DDP over a
regionally compiled model, on gloo with 2 CPU ranks: gradients equal an eager reference of the same
selection (each rank's rows weighted by its rule, averaged over ranks), and every graph skips rows."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import capskip_fx
from helpers.distributed import PG_TIMEOUT, finish, free_port, spawn
from helpers.models import Tokens
from helpers.torch_features import needs_batch_marking

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")]
W, N = 2, 6
KEEP = [[0, 3], [1, 2, 5]]


def make_model():
    torch.manual_seed(0)
    return Tokens().double()


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(W * N, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (W * N,), generator=g)


def _worker(rank, port, path, engine):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=PG_TIMEOUT)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = make_model()
    keep = torch.tensor(KEEP[rank])
    opts = {"rule": "forced", "keep": lambda n: keep, "backend": "aot_eager"}
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
    capskip_fx.compile_regions(model, blocks=model.blocks, head=model.head, **opts)
    if engine == "fsdp2":
        fully_shard(model)
        run = model
    else:
        run = nn.parallel.DistributedDataParallel(model)
    x, y = make_data()
    sl = slice(rank * N, (rank + 1) * N)
    F.cross_entropy(run(x[sl].clone()), y[sl]).backward()
    st = capskip_fx.stats(model)
    weights = [torch.empty(N, dtype=torch.float64) for _ in range(W)]
    dist.all_gather(weights, st.weight)
    grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for k, p in model.named_parameters()}
    if rank == 0:
        torch.save({"grads": grads, "weight": torch.cat(weights), "stats": (st.mode, st.n, st.kept, st.rows),
                    "report": list(capskip_fx.report(model))}, path)
    finish(path, rank)


@needs_batch_marking
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_regional_compile_under_data_parallel_is_exact_and_skips_rows(tmp_path, engine):
    path = str(tmp_path / "out.pt")
    spawn(_worker, (free_port(), path, engine), W, path)
    out = torch.load(path, weights_only=False)
    expect = torch.zeros(W * N, dtype=torch.float64)
    for r, k in enumerate(KEEP):
        expect[[r * N + i for i in k]] = 1
    assert torch.equal(out["weight"], expect), out["weight"]
    assert out["stats"] == ("selected", N, len(KEEP[0]), len(KEEP[0])), out["stats"]
    ran = [r for r in out["report"] if r["steps"]]  # not a graph Dynamo traced and discarded (FSDP2's hooks)
    assert len(ran) == 3, f"two blocks and the head should each run a backward: {out['report']}"
    for r in ran:
        assert r["backward"] == "selected rows", f"a graph ran all rows: {r}"
        assert r["row_counts"] == [len(KEEP[0])], f"a graph ran all rows: {r}"
    # reference: every rank's weighted mean loss, gradients averaged over the ranks (what DDP / FSDP reduce)
    x, y = make_data()
    ref = make_model()
    loss = sum((F.cross_entropy(ref(x[r * N:(r + 1) * N]), y[r * N:(r + 1) * N], reduction="none")
                * expect[r * N:(r + 1) * N]).sum() / N for r in range(W)) / W
    loss.backward()
    for k, p in ref.named_parameters():
        got = out["grads"][k]
        err = float((got - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
        assert err < 1e-10, f"{engine}: {k} gradient error {err:.3g}"
