"""Where a benchmark's results go: ``<stem>.json`` (the data) and ``<stem>.md`` (the table), side by side."""
from __future__ import annotations

import json
import pathlib


def write_results(stem: pathlib.Path, data, markdown: str) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    stem.with_suffix(".md").write_text(markdown.rstrip("\n") + "\n")
