"""The run's own view in the sinks that keep one run per rank (TensorBoard, W&B): what no one rank's records hold.

Once every rank has written its run_end, rank 0 (dflash/final.py) hands the whole run's report (`dflash-report
hotspots --json`'s dict) to `write`, which adds, beside the ranks' own:
- TensorBoard: RUN_DIR/tensorboard/run/, a TensorBoard run of its own: the verdict with the windows it was read
  over and its evidence (text `run/verdict`), the findings with their next experiment (`run/findings`), what the
  steady state is per role (`run/steady_window`), and per role the steady state's figures as scalars
  `steady/tokens_per_s/ROLE`, `steady/model_flops_per_s/ROLE`, `steady/mfu/ROLE/PEAK`, at the run's last step;
- W&B: a run named `run` (job type `run`) in the run's group, its summary holding the same figures under the same
  keys, the verdict as `verdict` and its text as `run/verdict`, `run/findings`, `run/steady_window`.
Every figure is the report's (one window: the steady state of each role, said in `run/steady_window`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VIEW_SINKS = ("tensorboard", "wandb")
"""The sinks that get the run's view: the ones that otherwise hold only each rank's own."""
NAME = "run"
"""The view's TensorBoard subdirectory (beside rank{R}/) and its W&B run's name and job type."""


@dataclass(frozen=True)
class RunView:
    """The run's figures and texts, as written to each sink."""
    step: int
    """The run's last training step: where the view's scalars and texts sit on the step axis."""
    verdict: str
    """The verdict (drafter-bound, target-bound, ...; "none" where the run has none)."""
    texts: dict
    """{tag: markdown}: run/verdict, run/findings, run/steady_window."""
    scalars: dict
    """{tag: value}: steady/tokens_per_s/ROLE, steady/model_flops_per_s/ROLE, steady/mfu/ROLE/PEAK."""


def run_view(report: dict, step: int) -> RunView:
    """The view of a hotspots report (report.hotspots's dict) at the run's last step."""
    v = report["verdict"]
    over = "; ".join(f"{role}: {r['window']}, {r['wall_seconds']:.0f} s" for role, r in v["roles"].items())
    verdict = v["verdict"] or "none"
    texts = {"run/verdict": "\n".join([f"**{verdict}** (read over {over or 'no intervals'})", "",
                                       *(f"- {e}" for e in v["evidence"])]),
             "run/findings": "\n".join(f"{i}. {f['summary']}  \n   next: {f['next']}"
                                       for i, f in enumerate(report["findings"], 1)) or "none"}
    windows, scalars = [], {}
    for role, s in sorted(report["steady"]["roles"].items()):
        windows.append(f"- {role}: {s['window']}" + (f", {s['steady_seconds']:.1f} s, {s['steady_steps']} steps"
                                                    if s.get("steady_seconds") is not None else ""))
        for key in ("steady_tokens_per_s", "steady_model_flops_per_s"):
            if s.get(key) is not None:
                scalars[f"steady/{key.removeprefix('steady_')}/{role}"] = float(s[key])
        for peak, mfu in sorted((s.get("mfu") or {}).items()):
            if mfu is not None:
                scalars[f"steady/mfu/{role}/{peak}"] = float(mfu)
    texts["run/steady_window"] = "\n".join(windows) or "no steady state"
    return RunView(step, verdict, texts, scalars)


def write(run_dir, run_id: str, sinks: list, report: dict, step: int, timeout_s: float = 30.0) -> list:
    """The view in each of `sinks` that keeps one (VIEW_SINKS); the paths written."""
    view = run_view(report, step)
    written = []
    if "tensorboard" in sinks:
        written.append(write_tensorboard(Path(run_dir), view))
    if "wandb" in sinks:
        written.append(write_wandb(Path(run_dir), run_id, view, timeout_s))
    return written


def write_tensorboard(run_dir: Path, view: RunView) -> Path:
    """RUN_DIR/tensorboard/run/: the view's texts and scalars at its step."""
    from torch.utils.tensorboard import SummaryWriter

    logdir = run_dir / "tensorboard" / NAME
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for tag, text in view.texts.items():
            writer.add_text(tag, text, view.step)
        for tag, value in view.scalars.items():
            writer.add_scalar(tag, value, view.step)
    finally:
        writer.close()
    return logdir


def write_wandb(run_dir: Path, run_id: str, view: RunView, timeout_s: float) -> Path:
    """A W&B run `run` in the run's group (under RUN_DIR/wandb, offline as the ranks' are): the view in its
    summary, its scalars also logged at the view's step; finished within timeout_s (exporters/wandb_run.py)."""
    import os

    import wandb

    from exporters.wandb_run import finish_within, init_mode

    root = run_dir / "wandb"
    root.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dflash"), group=run_id, name=NAME, job_type=NAME,
                     dir=str(run_dir), mode=init_mode(), config={"run_id": run_id}, reinit="create_new",
                     settings=wandb.Settings(console="off", quiet=True))
    if view.scalars:
        run.log(dict(view.scalars), step=view.step)
    run.summary.update({"verdict": view.verdict, **view.texts, **view.scalars})
    finish_within(run, timeout_s, "the run view", root)
    return root
