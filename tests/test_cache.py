"""Caching (issue 14.4): the pass uuid is the graph-side source plus the config, so Inductor's FX graph
cache serves our graphs across processes; a served graph still runs the selection (the selected-row
runtime is rebuilt around it at every compile), and its gradients stay exact."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from capskip_fx.config import CapskipConfig
from capskip_fx.passes import insert_select
from capskip_fx.passes.insert_select import InsertSelectPass


class _Backend:  # what the pass reads of the backend
    def __init__(self, key, config):
        self.key, self.config = key, config


def test_uuid_is_source_and_config_not_the_registry_key(tmp_path, monkeypatch):
    a = InsertSelectPass(_Backend(1, CapskipConfig())).uuid()
    assert a == InsertSelectPass(_Backend(2, CapskipConfig())).uuid()  # another process numbers keys anew
    assert a != InsertSelectPass(_Backend(1, CapskipConfig(gather_below=0.5))).uuid()
    assert a != InsertSelectPass(_Backend(1, CapskipConfig(vcas=True))).uuid()
    files = insert_select.source_files()
    assert any(f.endswith(os.path.join("passes", "insert_select.py")) for f in files)
    assert not any("train" in f.split(os.sep) for f in files)
    uuids = []
    for i, text in enumerate(("x = 1\n", "x = 2\n")):  # an edited pass must not be served its old graphs
        src = tmp_path / f"v{i}" / "pass.py"  # torch caches each path's hash per process: one path per version
        src.parent.mkdir()
        src.write_text(text)
        monkeypatch.setattr(insert_select, "source_files", lambda src=src: (str(src),))
        uuids.append(InsertSelectPass(_Backend(1, CapskipConfig())).uuid())
    assert uuids[0] != uuids[1]


_CHILD = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, torch.nn.functional as F
    import capskip_fx
    from torch._dynamo.utils import counters
    sys.path.insert(0, "tests")
    from conftest import max_rel_err
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 5))
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="inductor")
    x, y = torch.randn(12, 6), torch.randint(0, 5, (12,))
    F.cross_entropy(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    (F.cross_entropy(model(x), y, reduction="none") * st.weight).mean().backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                      "rows": st.rows, "kept": st.kept, "err": max_rel_err(got, ref)}))
""")


def test_restart_serves_cached_graphs_and_still_selects(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=root, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["miss"] >= 2 and warm["miss"] == 0 and warm["hit"] >= 2, runs  # forward and backward served
    for r in runs:  # the served backward still runs on the kept rows only, exactly
        assert r["kept"] == 6 and r["rows"] == 6 and r["err"] < 1e-5, runs
