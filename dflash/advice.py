"""dflash-train's advice: the report's findings said with the trainer's flags, and the pipeline's own rules (the
target waiting on transfer slots, a better target:drafter split). `dflash-report` and rank 0's end of the run pass
ADVICE to report.hotspots; a loop of its own gets the report's generic advice. Every flag, setting and span named
here comes from its definition (`flag`, `key`, `env_var`, pipeline.name), so a rename breaks the import or
tests/dflash/test_advice.py, not a sentence. A flag is advised only where the trainer accepts it on the run's
topology (report.advice.run_topology). Standard library only (dflash-report never imports torch).
"""
from __future__ import annotations

from dataclasses import fields

from dflash import pipeline
from dflash.config import _ENV, SECTIONS, TrainConfig
from profiler.report.analysis import WAIT_BOUND_SHARE
from profiler.report.findings import LAUNCH_FIXES, RULES, Advice, finding, straggler
from profiler.report.memory_forecast import largest_of

SPLIT_GAIN = 0.10              # a better split must predict at least this much more throughput


def _field(path: str):
    """The TrainConfig field at "section.name" ("run_dir" for the top level); a KeyError when there is none."""
    section, _, name = path.rpartition(".")
    return {f.name: f for f in fields(SECTIONS[section] if section else TrainConfig)}[name]


def key(path: str) -> str:
    """The flag key of a TrainConfig field: its name in run_start's config and the flag's words."""
    f = _field(path)
    return f.metadata.get("flag", f.name)


def flag(path: str, off: bool = False) -> str:
    """The dflash-train flag that sets TrainConfig field `path` ("parallel.max_in_flight" -> "--max-in-flight");
    `off`: an on/off field's --no- form."""
    if off and not str(_field(path).type).startswith("bool"):
        raise TypeError(f"{path} is not an on/off field")
    return ("--no-" if off else "--") + key(path).replace("_", "-")


def env_var(path: str) -> str:
    """The DFLASH_* environment variable that sets TrainConfig field `path` (dflash/config.py _ENV)."""
    return next(var for var, k in _ENV.items() if k == key(path))


# What the advice names, each from its definition: a renamed field or span fails here, at import.
TRANSFER, SPLIT_FC, SPLIT_FC_OFF = (flag("parallel.transfer"), flag("parallel.split_fc_layers"),
                                    flag("parallel.split_fc_layers", off=True))
TOKENS, IN_FLIGHT, MAX_STEPS = flag("data.tokens_per_batch"), flag("parallel.max_in_flight"), flag("optim.max_steps")
TARGET_GPUS, DRAFTER_GPUS = flag("parallel.target_gpus"), flag("parallel.drafter_gpus")
MEMORY_HISTORY, RESUME, RUN_DIR = flag("profile.memory_history"), flag("reliability.resume"), flag("run_dir")
EVERY, PORT, STACKS = (flag("profile.interval_s"), flag("telemetry.metrics_port"),
                       flag("profile.stack_samples_per_interval"))
SPLIT_FC_ENV, FAULT_ENV = env_var("parallel.split_fc_layers"), env_var("reliability.fault")
KEYS = {path: key(path) for path in ("parallel.max_in_flight", "parallel.split_fc_layers", "data.max_length",
                                      "data.tokens_per_batch", "profile.interval_s")}
"""The run_start config keys the advice reads, by field."""
SEND, PACK = pipeline.name("transfer.send"), pipeline.name("target.pack_hidden")
HOST_COPIES = tuple(s.name for s in pipeline.SPANS if s.needs == pipeline.HOST_COPIES)
PINNED = ("check the host buffer is pinned and the copy non_blocking; a capture (dflash-profile capture, then "
          "dflash-report kernels) shows the copy's own bandwidth against the floor")
BARE_SEND = "time a bare torch.distributed send and receive of the batch's bytes between the two GPUs"


def _topology(report: dict) -> dict:
    return report["split"].get("topology") or {}


def _transfer_next(topo: dict) -> tuple[str, list]:
    """The other transfer path, where the trainer accepts it on this run's devices; else why there is none."""
    if topo.get("transfer") == "nccl":
        return f"try the host path ({TRANSFER} host) and {BARE_SEND}", [TRANSFER, "host"]
    if topo.get("nccl_allowed"):
        return f"try the device-to-device path ({TRANSFER} nccl) and {BARE_SEND}", [TRANSFER, "nccl"]
    why = topo.get("nccl_refused") or "the records do not say the run's devices"
    return (f"the host path is the only one here (the NCCL path needs CUDA and one GPU per rank; here: {why}); time "
            "bare pinned copies of the batch's bytes outside training", [])


def _more_drafter(report: dict) -> tuple[str, list]:
    """What to do about a slow drafter, given the split advice and the run's GPUs."""
    sp, topo = report["split"], _topology(report)
    best, now = sp.get("best"), sp.get("current")
    if best and now and (best["target_gpus"], best["drafter_gpus"]) != (now["target_gpus"], now["drafter_gpus"]):
        return (f"move GPUs to the drafters: the split advice for {sp['n_gpus']} GPUs says "
                f"{TARGET_GPUS} {best['target_gpus']} {DRAFTER_GPUS} {best['drafter_gpus']}",
                [TARGET_GPUS, str(best["target_gpus"]), DRAFTER_GPUS, str(best["drafter_gpus"])])
    if best:
        return (f"no split of {sp['n_gpus']} GPUs does better: make the drafter's step cheaper, or add a drafter GPU "
                f"(dflash-report hotspots --gpus {sp['n_gpus'] + 1} shows that split)", [])
    if topo.get("ranks_share_gpus"):
        return ("the ranks share a GPU, so no split applies: make the drafter's step cheaper, or give each rank its "
                f"own GPU (dflash-report hotspots --gpus {max(2, topo.get('ranks') or 2)} predicts that split)", [])
    return "make the drafter's step cheaper (on GPUs, dflash-report hotspots --gpus N predicts the split)", []


def slot_waits(report: dict, advice: Advice) -> list:
    """The target waiting WAIT_BOUND_SHARE or more of its time for a transfer slot: more in flight where the
    transfer bounds the run, else more of the drafter."""
    v = report["verdict"]
    target = v["roles"].get("target") or {}
    wait = target.get("wait_share")
    if wait is None or wait < WAIT_BOUND_SHARE:
        return []
    in_flight = report["config"].get(KEYS["parallel.max_in_flight"])
    if v["verdict"] == "transfer-bound":
        nxt = (f"raise {IN_FLIGHT} from {in_flight} to {2 * in_flight}" if in_flight
               else f"raise {IN_FLIGHT} to 4") + f" and check {SEND}'s bandwidth against its floor"
        flags = [IN_FLIGHT, str(2 * in_flight if in_flight else 4)]
    else:
        nxt, flags = _more_drafter(report)
    return [finding("target_waits_on_slots", f"the target waits {wait:.0%} of its time for a transfer slot "
                                             f"(target: {target['window']})",
                    "; ".join(f"{role}: {r['window']}, {r['wall_seconds']:.0f} s" for role, r in v["roles"].items())
                    + ": " + "; ".join(v["evidence"]), nxt, flags)]


def split(report: dict, advice: Advice) -> list:
    """A target:drafter split of the run's GPUs predicted at least SPLIT_GAIN faster than its own."""
    s = report["split"]
    best, now = s.get("best"), s.get("current")
    if not best or not now or (best["target_gpus"], best["drafter_gpus"]) == (now["target_gpus"], now["drafter_gpus"]):
        return []
    gain = best["predicted_tokens_per_s"] / now["predicted_tokens_per_s"] - 1 if now["predicted_tokens_per_s"] else None
    if gain is None or gain < SPLIT_GAIN:
        return []
    flags = [TARGET_GPUS, str(best["target_gpus"]), DRAFTER_GPUS, str(best["drafter_gpus"])]
    return [finding("split", f"a {best['target_gpus']}:{best['drafter_gpus']} split of {s['n_gpus']} GPUs is "
                             f"predicted {gain:.0%} faster than this run's {now['target_gpus']}:{now['drafter_gpus']}",
                    f"capacity per GPU (steady_tokens_per_s over the busy share of each rank's window) target "
                    f"{s['roles']['target']['capacity_tokens_per_s_per_gpu']:.4g}, drafter "
                    f"{s['roles']['drafter']['capacity_tokens_per_s_per_gpu']:.4g} tokens/s; predicted "
                    f"{best['predicted_tokens_per_s']:.4g} vs {now['predicted_tokens_per_s']:.4g} tokens/s",
                    f"rerun with {' '.join(flags)}" + ("" if s.get("n_gpus_from") == "the run"
                                                       else f" on {s['n_gpus']} GPUs"), flags)]


def _after(rules: tuple, rule, *more) -> tuple:
    """`rules` with `more` right after `rule`."""
    i = rules.index(rule) + 1
    return (*rules[:i], *more, *rules[i:])



class PipelineAdvice(Advice):
    """The findings of a dflash-train run in the trainer's flags, with the pipeline's rules (slot waits, split)
    after the straggler's."""

    rules = _after(RULES, straggler, slot_waits, split)
    stall_hint = (f"; a first call that compiles shows as {pipeline.name('drafter.compile')} or "
                  f"{pipeline.name('triton.autotune')}")

    def for_report(self, report: dict) -> Advice:
        """This advice for a dflash-train run (a target or drafter rank), the generic one for a loop of its own."""
        return self if report.get("pipeline", True) else Advice()

    def copy(self, report: dict, span: str) -> tuple[str, list]:
        if span == SEND:
            return _transfer_next(_topology(report))
        if span == PACK:
            if report["config"].get(KEYS["parallel.split_fc_layers"]):
                return f"try {SPLIT_FC_OFF} (concatenate on the target, ship one tensor)", [SPLIT_FC_OFF]
            return f"try {SPLIT_FC} (ship the layers, concatenate on the drafter)", [SPLIT_FC]
        if span in HOST_COPIES:
            return PINNED, []
        return super().copy(report, span)

    def _margin(self, report: dict, otherwise: str) -> tuple[str, list]:
        """Lower the tokens per batch to the memory forecast's largest (or the margin's) where the trainer takes it
        (at least max_length); else `otherwise`."""
        margin, what = _largest_batch(report)
        max_length = report["config"].get(KEYS["data.max_length"]) or 1
        now = report["config"].get(KEYS["data.tokens_per_batch"])
        if margin and margin >= max_length and (now is None or margin < now):
            return f"lower {TOKENS} to {margin} (the {what})", [TOKENS, str(margin)]
        if margin is not None and margin < max_length:
            return (f"{otherwise}: the {what} ({margin} tokens) is under the run's max_length ({max_length}), "
                    "the least tokens per batch the trainer takes", [])
        return otherwise, []

    def smaller_batch(self, report: dict) -> tuple[str, list]:
        return self._margin(report, "lower the tokens per batch")

    def less_memory(self, report: dict) -> tuple[str, list]:
        return self._margin(report, "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")

    def larger_batch(self, report: dict) -> tuple[str, list]:
        margin, what = _largest_batch(report)
        now = report["config"].get(KEYS["data.tokens_per_batch"])
        if margin and now and margin > now:
            return (f"{LAUNCH_FIXES}; or a larger batch: raise {TOKENS} to {margin} (the {what})",
                    [TOKENS, str(margin)])
        return f"{LAUNCH_FIXES}; or a larger batch ({TOKENS}) where memory allows", []

    def memory_history(self) -> tuple[str, list]:
        return f"{MEMORY_HISTORY} 100000", [MEMORY_HISTORY, "100000"]

    def event(self, report: dict, kind: str, first: dict) -> tuple[str, list]:
        if kind == "nonfinite":
            step = first.get("step")
            to = [MAX_STEPS, str(step)] if isinstance(step, int) and step >= 1 else []
            flags = [IN_FLIGHT, "1", *to]
            return (f"rerun with {' '.join(flags)}, then with {SPLIT_FC_ENV} toggled: a NaN "
                    "that goes away is a race between streams or a freed buffer, one that stays is the span's math",
                    flags)
        if kind == "signal":
            resume = [RESUME, RUN_DIR, report["run_dir"]]
            return f"nothing to fix if the stop was intended: continue it with {' '.join(resume)}", resume
        if kind == "run_failed":
            return (f"read the rank's stderr and its last event; rerun with the failing step's "
                    f"{FAULT_ENV} to reproduce", [])
        return super().event(report, kind, first)

    def profiler_cost(self, report: dict) -> tuple[str, list]:
        interval = (report.get("config") or {}).get(KEYS["profile.interval_s"])
        known = isinstance(interval, (int, float)) and interval > 0
        longer = f"{2 * interval:g}" if known else "120"
        now = f" (now {interval:g} s)" if known else ""
        return (f"raise {EVERY}{now} to {longer}, drop exporters nobody reads ({PORT} 0, no "
                f"OTEL_EXPORTER_OTLP_ENDPOINT, {STACKS} 0), and see the interval records' threads_cpu_seconds for "
                "the thread that costs it", [EVERY, longer, PORT, "0", STACKS, "0"])


ADVICE = PipelineAdvice()
"""What dflash-report and the end of a run pass to report.hotspots."""


def _largest_batch(report: dict) -> tuple:
    """(the largest tokens per batch that fits, what says so): the memory forecast's where it has one (each step's
    allocator peak), else the memory margin's (whole-run peaks), else (None, "memory margin")."""
    largest = largest_of(report.get("memory_forecast") or {}, KEYS["data.tokens_per_batch"])
    if largest is not None:
        return largest, "memory forecast"
    return report["memory_margin"].get("max_tokens_per_batch"), "memory margin"
