"""Fault injection for tests: "KIND@SPAN[:step=N][:rank=R]" items separated by ';' (the trainer reads the spec
from DFLASH_FAULT; this module reads no environment), KIND one of nan, oom, crash, hang, slow=SECONDS, drift, e.g.
"slow=0.5@target.fwd:rank=0;crash@drafter.optim:step=10:rank=1". Faults take the real paths the forensics
watch (a raised torch.OutOfMemoryError, a NaN tensor in a span's output, a stuck span). With `step=N`, nan
and slow fire at step N; crash, oom and hang once, at the span's first entry at step N or later (a background
thread's span, transfer.send on the sender thread, can run while its role's step is already past N).

`drift@SPAN:step=S,factor=F` (options after the first may be separated by ',' or ':') multiplies the tensor the
span hands its corrupt() hook by F**(k-S+1) at every step k >= S: a value growing geometrically until it overflows
(after a few dozen steps at F=4), what the numerics early warning (profiler/numerics.py) must see coming. It needs
both options.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass

logger = logging.getLogger("profiler")

ENV_VAR = "DFLASH_FAULT"   # how messages name the spec: the variable the trainer reads it from
KINDS = ("nan", "oom", "crash", "hang", "slow", "drift")
CORRUPTING = ("nan", "drift")   # the kinds a span's corrupt() hook fires (the others fire on its entry)
_SPAN_RE = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")
_EXPECTED = "expected KIND@SPAN[:step=N][:rank=R] with KIND one of nan, oom, crash, hang, slow=SECONDS, drift"


class InjectedFault(RuntimeError):
    """An injected crash (DFLASH_FAULT=crash@SPAN)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    """One of nan, oom, crash, hang, slow, drift."""
    span: str
    """The span name whose entry (or, for nan, whose corrupt() hook) fires the fault."""
    step: int | None
    """Fire only at this training step; None fires every time."""
    rank: int | None
    """Fire only on this rank; None fires on every rank."""
    seconds: float | None
    """How long a slow fault sleeps; None for every other kind."""
    factor: float | None = None
    """A drift fault's growth per step (> 1); None for every other kind."""


def parse_fault(part: str) -> Fault:
    """One KIND@SPAN[:step=N][:rank=R] item; ValueError naming the bad part."""
    if part.count("@") != 1:
        raise ValueError(f"{ENV_VAR}: bad fault {part!r} ({_EXPECTED})")
    kind_text, rest = part.split("@")
    kind, _, seconds_text = kind_text.partition("=")
    seconds = None
    if kind_text == "slow":
        raise ValueError(f"{ENV_VAR}: slow needs a number of seconds (slow=SECONDS) in {part!r}")
    if kind == "slow":
        try:
            seconds = float(seconds_text)
        except ValueError:
            seconds = math.nan   # refused below, with the negative and infinite ones
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"{ENV_VAR}: slow needs a non-negative number of seconds, got {seconds_text!r} "
                             f"in {part!r}")
    elif kind_text not in KINDS:
        raise ValueError(f"{ENV_VAR}: unknown fault kind {kind_text!r} in {part!r} "
                         "(expected nan, oom, crash, hang, slow=SECONDS, drift)")
    span, *options = re.split(r"[:,]", rest)
    if not _SPAN_RE.match(span):
        raise ValueError(f"{ENV_VAR}: bad span name {span!r} in {part!r} (expected e.g. drafter.fwd_bwd)")
    found = _options(options, part, kind == "drift")
    if kind == "drift" and ("step" not in found or "factor" not in found):
        raise ValueError(f"{ENV_VAR}: drift needs step=S and factor=F in {part!r} (e.g. "
                         "drift@target.pack_hidden:step=20,factor=4)")
    return Fault(kind=kind, span=span, step=found.get("step"), rank=found.get("rank"), seconds=seconds,
                 factor=found.get("factor"))


def _options(options: list, part: str, drift: bool) -> dict:
    """The step=N, rank=R (and for drift factor=F) options of one item; ValueError naming the bad one."""
    keys = ("step", "rank", "factor") if drift else ("step", "rank")
    found: dict = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in keys:
            expected = "step=N, rank=R or factor=F" if drift else "step=N or rank=R"
            raise ValueError(f"{ENV_VAR}: unknown option {option!r} in {part!r} (expected {expected})")
        if key in found:
            raise ValueError(f"{ENV_VAR}: {key} given twice in {part!r}")
        if key == "factor":
            try:
                found[key] = float(value)
            except ValueError:
                found[key] = math.nan   # refused below, with the infinite ones and those not above 1
            if not (math.isfinite(found[key]) and found[key] > 1):
                raise ValueError(f"{ENV_VAR}: factor must be a finite number above 1, got {value!r} in {part!r}")
            continue
        if not re.fullmatch(r"[0-9]+", value):
            raise ValueError(f"{ENV_VAR}: {key} must be a non-negative integer, got {value!r} in {part!r}")
        found[key] = int(value)
    return found


def parse_faults(text: str) -> list[Fault]:
    """Every ';'-separated item of a DFLASH_FAULT value (blank items are ignored)."""
    return [parse_fault(part.strip()) for part in text.split(";") if part.strip()]


def check_injection_points(faults: list[Fault], spans, nan_spans, drift_spans=()) -> None:
    """ValueError (one line) for a fault that could never fire: on a span the program never enters (`spans`),
    a nan fault on a span without a corrupt() hook (`nan_spans`), or a drift fault on one without a drift point
    (`drift_spans`). For start-up, before any work."""
    for fault in faults:
        points = {"nan": nan_spans, "drift": drift_spans}.get(fault.kind, spans)
        if fault.span in points:
            continue
        why = (f"has no {fault.kind} injection point" if fault.span in spans or fault.span in nan_spans
               else "is not a span of this program")
        raise ValueError(f"{ENV_VAR}: {fault.kind}@{fault.span}: {fault.span} {why} "
                         f"({fault.kind} fires at: {', '.join(sorted(points))})")


class FaultPlan:
    """The faults that apply to one rank, indexed by span for a one-lookup check on span entry."""

    def __init__(self, faults: list[Fault], rank: int, sleep=time.sleep):
        self.rank = int(rank)
        self._sleep = sleep
        self.faults = tuple(f for f in faults if f.rank is None or f.rank == self.rank)
        self._by_span: dict[str, list] = {}       # span -> faults fired on its entry
        self._nan_by_span: dict[str, list] = {}   # span -> nan and drift faults, fired by its corrupt() hook
        for fault in self.faults:
            (self._nan_by_span if fault.kind in CORRUPTING else self._by_span).setdefault(fault.span, []).append(fault)
        self._logged: set[Fault] = set()
        self._fired: set[Fault] = set()     # one-shot faults (crash, oom, hang with a step) that fired

    @classmethod
    def from_spec(cls, spec: str, rank: int) -> FaultPlan:
        """The plan of `rank` from a spec string ("" or None: no faults)."""
        return cls(parse_faults(spec or ""), rank)

    @property
    def empty(self) -> bool:
        return not self.faults

    def _log_once(self, fault: Fault, message: str) -> None:
        if fault not in self._logged:
            self._logged.add(fault)
            logger.warning("%s (%s)", message, ENV_VAR)

    def on_enter(self, span: str, step: int) -> None:
        """Fire the faults of `span` at `step`: raise, sleep or hang. One dict lookup otherwise."""
        for fault in self._by_span.get(span, ()):
            if fault.step is not None and (fault.step != step if fault.kind == "slow"
                                           else step < fault.step or fault in self._fired):
                continue
            if fault.step is not None and fault.kind != "slow":
                self._fired.add(fault)
            where = f"at {span} step {step} rank {self.rank}"
            if fault.kind in ("crash", "oom"):
                self._log_once(fault, f"injected {fault.kind} {where}")
                if fault.kind == "crash":
                    raise InjectedFault(f"injected crash {where}")
                import torch   # loaded already: a span that can OOM runs torch
                raise torch.OutOfMemoryError(f"CUDA out of memory: injected oom {where}")
            if fault.kind == "slow":
                self._log_once(fault, f"injected slow={fault.seconds:g} {where} (logged once)")
                self._sleep(fault.seconds)
            elif fault.kind == "hang":
                self._log_once(fault, f"injected hang {where}: blocking until the process is killed")
                while True:
                    self._sleep(1.0)

    def corrupt(self, span: str, step: int, tensor, kinds=CORRUPTING):
        """`tensor` (no sync) times NaN when a nan fault matches span and step, times F**(step-S+1) when a drift
        fault's step S is at or before `step`; else the tensor itself. `kinds`: the kinds this hook fires (a span
        with two hooks gives each its own)."""
        for fault in self._nan_by_span.get(span, ()):
            if fault.kind not in kinds:
                continue
            fires = (fault.step is None or fault.step == step) if fault.kind == "nan" else step >= fault.step
            if fires:
                if not tensor.is_floating_point():
                    raise ValueError(f"{ENV_VAR}: {fault.kind}@{span} needs a floating-point tensor, got {tensor.dtype}")
                if fault.kind == "nan":
                    self._log_once(fault, f"injected nan at {span} step {step} rank {self.rank}")
                    return tensor * float("nan")
                self._log_once(fault, f"injected drift x{fault.factor:g} a step at {span} from step {step} rank "
                                      f"{self.rank} (logged once)")
                try:
                    scale = fault.factor ** (step - fault.step + 1)
                except OverflowError:   # past a float's range: the product overflows as the tensor would
                    scale = math.inf
                return tensor * scale
        return tensor
