"""Imports run one way, as docs/ARCHITECTURE.md draws them: every `import` of ours in the product (module level or
inside a function) is checked against the floors, and the readers of run logs import no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash", "exporters", "profiler")
"""The product's top-level import names (pyproject's packages): no other is installed into a user's environment."""
REPORT = "profiler.report"
CLIENTS = "profiler.clients"
SCHEMA = "profiler.schema"
ROOMS = (REPORT, CLIENTS, SCHEMA)
"""The rooms inside profiler: the offline report, the out-of-process clients, the run-log schema."""
MAY_IMPORT = {
    "dflash": {"dflash", "exporters", REPORT, CLIENTS, "profiler", SCHEMA},
    "exporters": {"exporters", "profiler", SCHEMA},
    REPORT: {REPORT, "profiler", SCHEMA},
    CLIENTS: {CLIENTS, "profiler", SCHEMA},
    "profiler": {"profiler", SCHEMA},
    SCHEMA: {SCHEMA},
}
"""Each floor and the floors of ours it may import (ARCHITECTURE.md's floors): the live sinks (exporters), the
offline report and the clients never import each other; the profiler's core imports only the schema; the schema
imports nothing of ours outside itself, so every reader can stand on it."""


def floor(module: str) -> str:
    """The floor a module of ours stands on: each room inside profiler is a floor of its own."""
    for room in ROOMS:
        if module == room or module.startswith(room + "."):
            return room
    return module.split(".")[0]


def _schema_modules():
    return tuple(f"{SCHEMA}.{p.stem}" for p in sorted((REPO / SCHEMA.replace(".", "/")).glob("*.py"))
                 if p.stem != "__init__")


NO_TORCH = (SCHEMA, *_schema_modules(), CLIENTS, f"{CLIENTS}.snapshot", f"{CLIENTS}.capture_client",
            f"{CLIENTS}.top", REPORT, f"{REPORT}.check", f"{REPORT}.trace", f"{REPORT}.plot", f"{REPORT}.kernels",
            f"{REPORT}.memory_snapshot", "exporters.catalog", "exporters.fold", "exporters.dashboard",
            "exporters.rules", "dflash.report_cli", "dflash.profile_cli", "dflash.advice", "dflash.pipeline")
"""Modules `dflash-report` and `dflash-profile` load: each imports without torch (they start in well under a second)."""


def _modules():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            yield name, path


def _imports(path: Path) -> set:
    """Every absolute module name of ours the file imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return {name for name in out if name.split(".")[0] in PACKAGES}


@pytest.mark.parametrize("name, path", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_import_points_down_a_floor(name, path):
    here = floor(name)
    wrong = sorted(m for m in _imports(path) if floor(m) not in MAY_IMPORT[here])
    assert not wrong, f"{name} imports {wrong}, above its floor ({here} may import {sorted(MAY_IMPORT[here])})"


def test_the_schema_room_holds_the_record_modules():
    """The run-log schema's modules are where ARCHITECTURE.md says (a move that leaves one behind fails here)."""
    assert {"records", "views", "windows", "span_kinds"} <= {m.rsplit(".", 1)[1] for m in _schema_modules()}


def test_no_package_is_imported_in_a_cycle():
    """The floors' graph (module level and inside functions) has no cycle: floors import one way."""
    graph = {p: set() for p in MAY_IMPORT}
    for name, path in _modules():
        graph[floor(name)] |= {floor(m) for m in _imports(path)} - {floor(name)}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])
    assert not [p for p in MAY_IMPORT if reaches(p, p)]


def test_the_readers_import_no_torch():
    code = ("import importlib, sys\n"
            f"for m in {list(NO_TORCH)!r}:\n"
            "    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, m\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
