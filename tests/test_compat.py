"""A torch whose internals moved fails when the library loads, naming the version and what is missing."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from capskip_fx import compat


def test_this_torch_has_every_required_internal():
    assert compat.missing() == [], f"this torch lacks internals the library relies on: {compat.missing()}"


def test_a_missing_internal_is_named_with_the_torch_version(monkeypatch):
    monkeypatch.setattr(compat, "REQUIRED", compat.REQUIRED + (("torch._C", "_no_such_thing", "a test"),))
    with pytest.raises(ImportError, match=r"(?s)torch \S+.*torch\._C\._no_such_thing \(a test\)") as e:
        compat.check()
    assert torch.__version__ in str(e.value), (
        f"the import error must name the running torch version {torch.__version__}; it reads {str(e.value)!r}")


@pytest.mark.subprocess
@pytest.mark.parametrize("entry", ["from capskip_fx import compile", "import capskip_fx.dynamo_entry"])
def test_import_fails_loudly_when_an_internal_moved(entry):
    """The package itself loads lazily (a torch-free ``--help``); its two entry points, the API and the
    ``backend="capskip"`` entry point, check the internals when they load."""
    code = ("import torch; del torch._C._current_autograd_node\n"
            f"try:\n    {entry}\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "IMPORT-ERROR" in out, out
    assert "_current_autograd_node" in out, out
    assert torch.__version__ in out, out
