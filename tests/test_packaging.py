"""The built wheel is what a user installs: it carries the license and registers the ``capskip`` backend."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # builds a wheel and starts fresh Python processes

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_into_a_clean_env_and_registers_the_backend(tmp_path):
    """Build the wheel (no network: this environment's setuptools), install it with --no-deps into a fresh
    venv that sees this environment's torch only as a plain path (so the editable checkout is not found),
    and compile a model with backend="capskip" there without importing capskip_fx."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("capskip_fx-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        eps = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "License-Expression: BSD-3-Clause" in meta, meta[:1500]
    assert any(n.endswith("licenses/LICENSE") for n in names), names
    assert "[torch_dynamo_backends]" in eps and "capskip = capskip_fx.dynamo_entry:backend" in eps, eps

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # torch from this environment, as a plain path: its .pth files (the editable capskip_fx) are not run
    Path(site, "torch_from_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                          "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "no such option: --python" in out.stderr:  # pip < 22.3
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                              "--target", site, str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    code = textwrap.dedent("""
        import importlib.metadata as md, torch, torch.nn as nn, torch.nn.functional as F
        ours = [ep for ep in md.entry_points(group="torch_dynamo_backends") if ep.name == "capskip"
                and str(ep.dist.locate_file("")).startswith(SITE)]
        assert ours, "the wheel's dist-info registers no capskip backend"
        assert "capskip" in torch._dynamo.list_backends()
        m = torch.compile(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3)), backend="capskip",
                          options={"rule": "forced", "keep": 0.5, "backend": "aot_eager"})
        for step in range(2):  # step 0: the static first batch (dense by design); step 1 selects
            F.cross_entropy(m(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        import capskip_fx
        assert capskip_fx.__file__.startswith(SITE), capskip_fx.__file__
        st = capskip_fx.stats(m)
        print("OK", st.kept, st.rows, md.metadata("capskip_fx")["License-Expression"])
    """).replace("SITE", repr(site))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CAPSKIP_RULE", "CAPSKIP_OPTIONS")}
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["OK", "4", "4", "BSD-3-Clause"], out.stdout
