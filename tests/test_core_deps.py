"""The core needs only torch: `import capskip_fx` and `capskip_fx.compile` work while the training
harness's extras (pip install capskip_fx[train]) are unimportable."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # starts Python processes

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("timm", "torchvision", "matplotlib", "sklearn", "tqdm", "yaml")

SCRIPT = textwrap.dedent("""
    import sys

    BLOCKED = sys.argv[1].split(",")
    # None in sys.modules: `import x` raises ModuleNotFoundError and importlib.util.find_spec("x") is None,
    # i.e. exactly "not installed" (torch probes optional packages with find_spec)
    for name in BLOCKED:
        sys.modules[name] = None
    import torch
    import torch.nn.functional as F
    import capskip_fx

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    F.cross_entropy(cm(x, capskip_targets=y), y).backward()
    st = capskip_fx.stats(cm)
    assert st.kept == 4, f"forced keep=0.5 must back-propagate 4 of the batch's 8 rows: {st}"
    assert st.n == 8, f"the step's stats must count the batch's 8 rows: {st}"
    assert all(p.grad is not None for p in model.parameters())
    loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in BLOCKED and mod is not None)
    assert not loaded, loaded
    try:  # control: the block works, the harness does need its extras
        import capskip_fx.train
    except ModuleNotFoundError as e:
        print("harness blocked:", e.name)
    print("core ok")
""")


def test_core_imports_and_compiles_without_the_train_extras():
    p = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(EXTRAS)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "core ok" in p.stdout, f"the core must import and compile with the train extras blocked; stdout {p.stdout!r}"
    assert "harness blocked:" in p.stdout, (
        f"the control failed: with its extras blocked the harness must not import; stdout {p.stdout!r}")
