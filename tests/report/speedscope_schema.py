"""speedscope's file-format schema (vendored: tests/report/data/README.md says from where) and a strict validator of
the JSON Schema keywords it uses (draft-07's $ref, type, enum, const, properties, required, items, anyOf), for
.venv has no `jsonschema`. A keyword it does not know is an error, never ignored, so a newer schema cannot pass
unread. Plus the rules speedscope's importer (src/lib/file-format.ts) applies that the schema cannot say."""
from __future__ import annotations

import json
from pathlib import Path

SCHEMA = json.loads((Path(__file__).parent / "data" / "speedscope-file-format-schema.json").read_text())
KNOWN = {"$schema", "$ref", "definitions", "title", "description", "type", "enum", "const", "properties",
         "required", "items", "anyOf"}
_TYPES = {"number": lambda v: type(v) in (int, float), "integer": lambda v: type(v) is int,
          "string": lambda v: type(v) is str, "boolean": lambda v: type(v) is bool, "null": lambda v: v is None,
          "array": lambda v: type(v) is list, "object": lambda v: type(v) is dict}


def _same(a, b) -> bool:
    """JSON equality (1 is not true)."""
    return type(a) is type(b) and a == b


def _resolve(ref: str, root: dict) -> dict:
    assert ref.startswith("#/definitions/"), f"only local definitions are read, not {ref}"
    return root["definitions"][ref.removeprefix("#/definitions/")]


def _local(inst, schema: dict, root: dict, path: str) -> list:
    """The errors of `inst` against `schema`'s keywords other than $ref."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](inst) for t in types):
            return [f"{path}: {type(inst).__name__} is not {'/'.join(types)}"]
    errors = []
    if "enum" in schema and not any(_same(inst, v) for v in schema["enum"]):
        errors.append(f"{path}: {inst!r} is not one of {schema['enum']}")
    if "const" in schema and not _same(inst, schema["const"]):
        errors.append(f"{path}: {inst!r} is not {schema['const']!r}")
    if type(inst) is dict:
        errors += [f"{path}: {k!r} is missing" for k in schema.get("required", ()) if k not in inst]
        for k, sub in schema.get("properties", {}).items():
            if k in inst:
                errors += validate(inst[k], sub, root, f"{path}.{k}")
    if type(inst) is list and "items" in schema:
        for i, item in enumerate(inst):
            errors += validate(item, schema["items"], root, f"{path}[{i}]")
    if "anyOf" in schema:
        branches = [validate(inst, sub, root, path) for sub in schema["anyOf"]]
        if all(branches):
            errors.append(f"{path}: matches no anyOf branch ({'; '.join(b[0] for b in branches)})")
    return errors


def validate(inst, schema: dict | None = None, root: dict | None = None, path: str = "$") -> list:
    """Every error of `inst` against `schema` (default: speedscope's file schema), one line each; [] when valid."""
    schema = SCHEMA if schema is None else schema
    root = schema if root is None else root
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"schema keywords this validator does not implement: {sorted(unknown)}")
    if "$ref" in schema:   # draft-07: a $ref's siblings are ignored
        return validate(inst, _resolve(schema["$ref"], root), root, path)
    return _local(inst, schema, root, path)


def import_errors(doc: dict) -> list:
    """What speedscope's importer refuses or misdraws in a valid file: a sampled profile whose samples and weights
    differ in length, a frame index outside shared.frames, a span (endValue - startValue) other than its weights'
    sum, and activeProfileIndex outside the profiles."""
    n_frames, errors = len(doc["shared"]["frames"]), []
    for i, p in enumerate(doc["profiles"]):
        if p["type"] != "sampled":
            continue
        if len(p["samples"]) != len(p["weights"]):
            errors.append(f"profiles[{i}]: {len(p['samples'])} samples, {len(p['weights'])} weights")
        if any(not (type(f) is int and 0 <= f < n_frames) for s in p["samples"] for f in s):
            errors.append(f"profiles[{i}]: a frame index outside shared.frames")
        if p["endValue"] - p["startValue"] != sum(p["weights"]):
            errors.append(f"profiles[{i}]: endValue - startValue is not the weights' sum")
    if not 0 <= doc.get("activeProfileIndex", 0) < len(doc["profiles"]):
        errors.append("activeProfileIndex outside the profiles")
    return errors
