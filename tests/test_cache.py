"""Caching (issue 14.4): the pass uuid is the graph-side source plus the config, so Inductor's FX graph
cache and AOTAutogradCache serve our graphs across processes and models; a served graph still runs the
selection (the backend rebuilds its wrappers around it from their stored description, for the compiling
model's state), and its gradients stay exact.  Graphs that call back into one model (registry key) and
VCAS configs are never stored in AOTAutogradCache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from capskip_fx import aot_cache
from capskip_fx.config import CapskipConfig
from capskip_fx.passes import pipeline
from capskip_fx.passes.pipeline import JointContext, JointPass


def _joint_pass(key, config, logits_index=None) -> JointPass:
    return JointPass(JointContext(key, logits_index, config.on_coupling), config)


def test_uuid_is_source_and_config_not_the_registry_key(tmp_path, monkeypatch):
    a = _joint_pass(1, CapskipConfig()).uuid()
    assert a == _joint_pass(2, CapskipConfig()).uuid(), (
        f"the cache key must not depend on the registry key (another process numbers keys anew); uuid {a!r}")  # another process numbers keys anew
    assert a != _joint_pass(1, CapskipConfig(gather_below=0.5)).uuid(), (
        f"gather_below changes the compiled graph: it must change the cache key; uuid {a!r}")
    assert a != _joint_pass(1, CapskipConfig(vcas=True)).uuid(), (
        f"vcas=True changes the compiled graph: it must change the cache key; uuid {a!r}")
    assert a != _joint_pass(1, CapskipConfig(), logits_index=1).uuid(), (
        f"another logits output is another head: it must change the cache key; uuid {a!r}")  # another head
    files = pipeline.source_files()
    assert any(f.endswith(os.path.join("passes", "insert_select.py")) for f in files), (
        f"the key should hash the passes' source (insert_select.py among them); files {files}")
    assert not any("train" in f.split(os.sep) for f in files), (
        f"the harness (train/) is not compiled into graphs: editing it must not invalidate the cache; files {files}")
    uuids = []
    for i, text in enumerate(("x = 1\n", "x = 2\n")):  # an edited pass must not be served its old graphs
        src = tmp_path / f"v{i}" / "pass.py"  # torch caches each path's hash per process: one path per version
        src.parent.mkdir()
        src.write_text(text)
        monkeypatch.setattr(pipeline, "source_files", lambda src=src: (str(src),))
        uuids.append(_joint_pass(1, CapskipConfig()).uuid())
    assert uuids[0] != uuids[1], f"an edited pass must not be served its old graphs: the key stayed {uuids[0]!r}"


_CHILD = textwrap.dedent("""
    import json, os, sys, torch, torch.nn as nn, torch.nn.functional as F
    import capskip_fx
    from torch._dynamo.utils import counters
    sys.path.insert(0, "tests")
    from conftest import max_rel_err
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 5))
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="inductor", gather=os.environ.get("GATHER", "eager"))
    x, y = torch.randn(12, 6), torch.randint(0, 5, (12,))
    loss = F.cross_entropy(cm(x), y)
    loss.backward(retain_graph=True)  # a served graph keeps our no-donated-buffers metadata
    st = capskip_fx.stats(cm)
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    loss.backward()
    model.zero_grad()
    (F.cross_entropy(model(x), y, reduction="none") * st.weight).mean().backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    with torch.no_grad():  # an inference graph
        same = torch.allclose(cm(x), model(x), atol=1e-6)
    aot = counters["aot_autograd"]
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                      "aot_hit": aot["autograd_cache_hit"], "aot_saved": aot["autograd_cache_saved"],
                      "cached": [r.cached for r in cm.backend.records], "same": same,
                      "rows": st.rows, "kept": st.kept, "err": max_rel_err(got, ref),
                      "gather": [(r.gather, r.graph_gathers) for r in cm.backend.records if r.plan is not None]}))
""")


def _run(code: str, tmp_path, gather: str = "eager") -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", GATHER=gather)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@pytest.mark.inductor
def test_restart_serves_cached_graphs_and_still_selects(tmp_path):
    cold, warm = runs = [_run(_CHILD, tmp_path) for _ in range(2)]
    if aot_cache.available():
        assert cold["miss"] >= 3, runs
        assert cold["aot_saved"] == 2, runs
        assert cold["cached"] == [False, False], runs
        # AOTAutograd serves both graphs (training, inference) with our wrappers rebuilt; no Inductor compile
        assert warm["aot_hit"] == 2, runs
        assert warm["cached"] == [True, True], runs
        assert warm["miss"] == 0, runs
        assert warm["hit"] >= 3, runs
    else:  # a torch without the rebuild hook: AOTAutogradCache stays off for our graphs, Inductor's serves them
        assert cold["aot_saved"] == warm["aot_hit"] == 0, runs
        assert warm["cached"] == [False, False], runs
        assert cold["miss"] >= 3, runs
        assert warm["miss"] == 0, runs
        assert warm["hit"] >= 3, runs
    for r in runs:  # the served backward still runs on the kept rows only, exactly
        assert r["kept"] == 6, runs
        assert r["rows"] == 6, runs
        assert r["err"] < 1e-5, runs
        assert r["same"], runs


@pytest.mark.subprocess
@pytest.mark.inductor
def test_restart_with_gather_in_graph_compiles_the_twin_again(tmp_path):
    """gather="graph": the selected backward is not served by AOTAutogradCache (two compiled graphs), so a
    restart rebuilds it, its twin included, from Inductor's FX graph cache, and still runs on the kept rows."""
    cold, warm = runs = [_run(_CHILD, tmp_path, "graph") for _ in range(2)]
    assert warm["miss"] == 0 and warm["hit"] >= 4, runs  # forward, inference, the backward and its twin
    assert cold["aot_saved"] <= 1, runs  # the inference graph at most: the training graphs are not described
    for r in runs:
        assert r["gather"] == [["graph", 2]], runs  # the step's backward and its retained second one, by the twin
        assert r["kept"] == 6 and r["rows"] == 6, runs
        assert r["err"] < 1e-5 and r["same"], runs


_WARM = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, torch.nn.functional as F
    import capskip_fx
    import capskip_fx.backend as backend
    from capskip_fx.passes import pipeline
    from capskip_fx.records import RefusalKind, Refused
    from torch._dynamo.utils import counters
    sys.path.insert(0, "tests")
    from conftest import max_rel_err
    torch._dynamo.config.recompile_limit = 64  # ten models of one class, each with its own cache entry
    x, y = torch.randn(12, 6), torch.randint(0, 5, (12,))
    KEYS = ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_saved")

    def step(model, cm):
        model.zero_grad()
        F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        got = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
        (F.cross_entropy(model(x), y, reduction="none") * st.weight).mean().backward()
        ref = {k: p.grad.clone() for k, p in model.named_parameters()}
        return {"rows": st.rows, "kept": st.kept, "err": max_rel_err(got, ref)}

    def run(keep, bn=False, **opts):
        torch.manual_seed(0)
        layers = [nn.Linear(6, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.GELU(), nn.Linear(16, 5)]
        model = nn.Sequential(*layers)
        cm = capskip_fx.compile(model, rule="forced", keep=keep, backend="inductor", **opts)
        before = {k: counters["aot_autograd"][k] for k in KEYS}
        out = step(model, cm) if not bn else {}
        if bn:
            F.cross_entropy(cm(x), y).backward()
        out.update({k: counters["aot_autograd"][k] - before[k] for k in KEYS})
        out["cached"] = [r.cached for r in cm.backend.records]
        out["report"] = [(str(r.backward), r.reason) for r in cm.backend.records]
        out["fallback"] = capskip_fx.stats(cm).fallback
        return out, (model, cm)

    out = {}
    out["a"], a = run(0.5)
    out["b"], _ = run(0.25)                      # same config, another model and rule state: served
    out["a_again"] = step(*a)                    # the first model keeps its own state
    out["c"], _ = run(0.5, gather_below=0.95)    # another config: not served
    out["bn1"], _ = run(0.5, bn=True)            # refused by the joint pass: dense, with its reason
    out["bn2"], _ = run(0.5, bn=True)
    out["v1"], _ = run(0.5, vcas=True)           # VCAS: AOTAutogradCache off
    out["v2"], _ = run(0.25, vcas=True)
    pipeline.plan_backward = lambda *a, **k: (_ for _ in ()).throw(Refused("test: refused plan", RefusalKind.SELECTION))
    out["d"], _ = run(0.5, gather_below=0.8)     # its backward calls select(..., key): never stored
    out["e"], _ = run(0.25, gather_below=0.8)
    backend.aot_cache.RebuildPolicy.wrap_output = lambda self, graph: graph  # a torch whose hit skips the hook
    try:
        run(0.5)
    except Exception as e:
        out["skipped_hook"] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.subprocess
@pytest.mark.inductor
@pytest.mark.skipif(not aot_cache.available(), reason=f"torch {torch.__version__} has no CUDAGraphPolicy.wrap_output: "
                    "AOTAutogradCache stays off for capskip graphs")
def test_warm_process_serves_other_models_their_own_state(tmp_path):
    r = _run(_WARM, tmp_path)
    hit, miss, saved = "autograd_cache_hit", "autograd_cache_miss", "autograd_cache_saved"
    assert r["a"][saved] == 1, r
    assert r["a"]["cached"] == [False], r
    assert (r["a"]["rows"], r["a"]["kept"]) == (6, 6), r
    assert r["b"][hit] == 1, r
    assert r["b"]["cached"] == [True], r
    assert (r["b"]["rows"], r["b"]["kept"]) == (3, 3), r
    assert (r["a_again"]["rows"], r["a_again"]["kept"]) == (6, 6), r
    assert r["c"][hit] == 0, r
    assert r["c"][miss] == 1, r
    assert r["bn1"][saved] == 1, r
    assert r["bn2"][hit] == 1, r
    assert r["bn2"]["cached"] == [True], r
    assert r["bn2"]["report"] == r["bn1"]["report"], r
    assert r["bn1"]["report"][0][0] == "dense", r
    assert r["bn2"]["fallback"] == r["bn1"]["fallback"], r
    assert "cross-example" in r["bn2"]["fallback"], r
    for k in ("v1", "v2"):
        assert r[k][hit] == r[k][miss] == r[k][saved] == 0, r
    assert r["d"][saved] == 0, r
    assert r["e"][hit] == 0, r  # the second model runs its own select
    assert (r["d"]["rows"], r["d"]["kept"]) == (12, 6), r
    assert (r["e"]["rows"], r["e"]["kept"]) == (12, 3), r
    assert "AOTAutogradCache served a graph without" in r["skipped_hook"], r  # loud, never silently dense
    for k in ("a", "b", "a_again", "c", "v1", "v2", "d", "e"):
        assert r[k]["err"] < 1e-5, (k, r)
