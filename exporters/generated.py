"""What the live sinks and the offline report share: the metric catalog, the trace events, the dashboard and rule
generators (and the write-or-check ending both generators share)."""
from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(out: Path, text: str, module: str, check: bool) -> int:
    """A generator's ending: write `text` to `out`, or with `check` say whether `out` already holds it (exit status
    1 when not, naming `python -m MODULE --out OUT` to regenerate it)."""
    if not check:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
        return 0
    if (out.read_text() if out.exists() else None) != text:
        print(f"{out} is out of date: run python -m {module} --out {out}", file=sys.stderr)
        return 1
    print(f"{out} is up to date")
    return 0
