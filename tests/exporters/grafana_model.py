"""Walking a generated Grafana dashboard model, for the tests that check its queries (statically here, against
a live Prometheus in tests/integration): the panels, their targets, and Grafana's variable interpolation."""
from __future__ import annotations

import re


def iter_panels(dashboard: dict):
    """Every panel, rows and the panels a collapsed row holds included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every target of every panel."""
    return [(panel.get("title", ""), target.get("refId", ""), target["expr"])
            for panel in iter_panels(dashboard) for target in panel.get("targets", [])]


# $var, ${var} (or ${var:format}) and [[var]], the three syntaxes Grafana interpolates.
_VARIABLE = re.compile(r"\$(\w+)|\$\{([^}]+)\}|\[\[([^\[\]]+)\]\]")


def substitute_variables(expr: str, values: dict) -> str:
    """`expr` with Grafana's variables replaced by `values` (globals with or without their leading
    underscores: `rate_interval` for `$__rate_interval`); a variable with no value is a KeyError."""
    def replace(match: re.Match) -> str:
        token = next(group for group in match.groups() if group is not None)
        name = token.split(":", 1)[0]
        for key in (name, name.lstrip("_")):
            if key in values:
                return str(values[key])
        raise KeyError(f"no value for {match.group(0)} in {expr!r}")

    return _VARIABLE.sub(replace, expr)
