"""Where a benchmark's results go: ``<stem>.json`` (the data) and ``<stem>.md`` (the table), side by side,
both stamped with when, where and at which commit they were written (``written``), so every number in the
docs can name its date, thread count and machine from its raw file."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _commit() -> str | None:
    try:
        # "-dirty": tracked files differed from the commit
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def provenance() -> dict:
    """When and where a result was written: UTC time, commit, torch, intra-op threads, load average, CPU
    (and GPU when CUDA is initialised)."""
    prov = {"utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": round(os.getloadavg()[0], 2), "cpu": _cpu_model(), "cores": os.cpu_count()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        prov["gpu"] = torch.cuda.get_device_name()
    return prov


def write_results(stem: pathlib.Path, data, markdown: str) -> None:
    """``data`` (a dict gets a ``written`` key; anything else goes under ``rows``) and ``markdown`` (a last
    line says when and where)."""
    prov = provenance()
    stem.parent.mkdir(parents=True, exist_ok=True)
    data = {**data, "written": prov} if isinstance(data, dict) else {"rows": data, "written": prov}
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    where = prov.get("gpu") or f"{prov['cpu']} ({prov['cores']} cores)"
    line = (f"Written {prov['utc']} at {prov['commit'] or 'an unknown commit'}, torch {prov['torch']}, "
            f"{prov['threads']} thread(s), load average {prov['load_average']}, {where}.")
    stem.with_suffix(".md").write_text(markdown.rstrip("\n") + "\n\n" + line + "\n")
