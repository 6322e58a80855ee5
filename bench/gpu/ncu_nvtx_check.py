"""`ncu --nvtx --nvtx-include "target.pack_hidden/"` profiles exactly that span's kernels: the kernels Nsight Compute
profiled in a short `--nvtx` run, per target.pack_hidden instance (the run log's count), against the kernels a
Kineto capture of another run of the same code path attributes to one instance of the span.

    python3 bench/gpu/ncu_nvtx_check.py NCU_CSV NCU_RUN_DIR CAPTURE_RUN_DIR

NCU_CSV is ncu's `--csv --log-file` output. Exit 1 when the two counts differ.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from profiler.schema.records import read_records  # noqa: E402
from profiler.report.kernels import kernels  # noqa: E402


def ncu_kernels(path: Path) -> list:
    """(process id, kernel id, name) of every kernel in ncu's CSV (one row per metric: deduplicated)."""
    rows = csv.DictReader(line for line in path.read_text().splitlines() if line.startswith('"'))
    return sorted({(r["Process ID"], r["ID"], r["Kernel Name"]) for r in rows if r.get("Kernel Name")})


def instances(run_dir: Path, name: str) -> int:
    ends = [r for p in sorted((run_dir / "profile").glob("rank*.jsonl")) for r in read_records(p)[0]
            if r.get("type") == "run_end"]
    return sum(((r.get("spans") or {}).get(name) or {}).get("count", 0) for r in ends)


def main(argv: list) -> int:
    csv_path, ncu_run, capture_run = map(Path, argv)
    found, n = ncu_kernels(csv_path), instances(ncu_run, "target.pack_hidden")
    span = next(s for r in kernels(capture_run)["ranks"] for s in r["spans"] if s["name"] == "target.pack_hidden")
    per_ncu = len(found) / n if n else float("nan")
    per_kineto = span["kernels_total"]["count"] / span["count"]
    print(f"ncu: {len(found)} kernels in {n} target.pack_hidden spans ({per_ncu:g} a span); Kineto capture: "
          f"{span['kernels_total']['count']} in {span['count']} ({per_kineto:g} a span)")
    for _pid, _id, name in found[:8]:
        print(f"  ncu kernel: {name[:100]}")
    print("match" if per_ncu == per_kineto else "MISMATCH")
    return 0 if per_ncu == per_kineto else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
