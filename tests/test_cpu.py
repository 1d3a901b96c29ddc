"""capskip_fx.cpu: the glibc malloc setting the CLI applies to CPU runs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from capskip_fx.cpu import retain_freed_memory

pytestmark = pytest.mark.subprocess  # starts Python processes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_retain_freed_memory_applies_and_opts_out(monkeypatch):
    code = "from capskip_fx.cpu import retain_freed_memory as r; print(r())"
    # a fresh process: mallopt changes this one's allocator for good
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True", (
        "a fresh process on glibc must apply the malloc setting that keeps freed memory (retain_freed_memory() True)")
    monkeypatch.setenv("CAPSKIP_MALLOC_TUNING", "0")
    assert retain_freed_memory() is False, "CAPSKIP_MALLOC_TUNING=0 must opt out of the malloc setting"
