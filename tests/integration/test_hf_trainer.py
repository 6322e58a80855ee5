"""The profiler in a loop no one here wrote (issue 37, item 2): a Hugging Face `Trainer` training a small Llama
built from a config on the CPU, profiled by docs/API.md's `TrainerCallback` (its python block, verbatim) and sampled
by py-spy, run for real in a fresh interpreter. Its run directory must read back: steps/s, the callback's spans,
hot frames of the training thread with the profiler's own threads apart, `dflash-report check` and `hotspots`
exit 0 without DFlash-only sections. Needs transformers and accelerate (the Trainer requires it: the `test` extra)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash import report_cli
from profiler.schema.records import read_records
from tests.report.test_loop_report import assert_no_pipeline_noise

pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate (pip install accelerate)")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECTION = "## A Hugging Face `Trainer`"
STEPS, BATCH, SEQ = 48, 4, 32

HARNESS = f'''
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import exporters
from profiler.stacks import make_stack_sampler

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


class Repeats(torch.utils.data.Dataset):
    """Sequences that repeat a random 4-token pattern: learnable next tokens."""

    def __len__(self):
        return 512

    def __getitem__(self, i):
        time.sleep(0.01)   # 40 ms a step: the 48 steps span several 0.5 s intervals on any machine (some steady)
        pattern = torch.randint(0, 128, (4,), generator=torch.Generator().manual_seed(i))
        ids = pattern.repeat({SEQ} // 4)
        return {{"input_ids": ids, "labels": ids.clone()}}


args = TrainingArguments(output_dir="hf-out", max_steps={STEPS}, per_device_train_batch_size={BATCH}, logging_steps=2,
                         learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                         dataloader_num_workers=0)
config = profiler.ProfilerConfig(interval_s=0.5)   # the default warm-up, as docs/API.md leaves it
deps = profiler.ProfilerDeps(stack_sampler=make_stack_sampler(os.getpid(), 2, config.interval_s))
with profiler.Profiler("runs/hf", role="trainer", config=config, deps=deps,
                       exporters=exporters.build("console,trace", metrics_port=0)):
    trainer = Trainer(model=model, args=args, train_dataset=Repeats(), callbacks=[ProfilerCallback({BATCH * SEQ})])
    trainer.train()
'''


def api_callback() -> str:
    """docs/API.md's TrainerCallback block, verbatim."""
    text = (REPO / "docs" / "API.md").read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(SECTION):], re.S).group(1)


def test_a_hugging_face_trainer_profiled_by_the_documented_callback_reads_back(tmp_path, capsys):
    (tmp_path / "train.py").write_text(api_callback() + HARNESS)
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false"))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "hf"
    recs, bad = read_records(run / "profile" / "rank0.jsonl")
    assert bad == 0
    (end,) = [r for r in recs if r["type"] == "run_end"]
    assert end["status"] == "ok" and end["step"] == STEPS - 1      # set_step(global_step) at each step's start
    assert end["spans"]["trainer.step"]["count"] == STEPS and end["spans"]["trainer.optim"]["count"] == STEPS
    assert end["counters"]["tokens"]["total"] == STEPS * BATCH * SEQ
    intervals = [r for r in recs if r["type"] == "interval"]
    assert sum(r["step_rate"]["steps"] for r in intervals if r.get("step_rate")) == STEPS - 1
    assert any("loss" in (r.get("metrics") or {}) for r in intervals)   # on_log's loss, as a metric
    logged = [float(x) for x in re.findall(r"'loss': '?([0-9.]+)", done.stdout)]
    assert len(logged) >= 2 and logged[-1] < logged[0], done.stdout[-2000:]   # it trains
    trace = json.loads((run / "trace" / "rank0.json").read_text())
    assert "trainer.step" in {e.get("name") for e in trace["traceEvents"]}

    capsys.readouterr()
    assert report_cli.main(["check", str(run)]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.startswith("check: ")
    assert report_cli.main(["hotspots", "--json", str(run)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["pipeline"] is False and rep["steady"]["roles"]["trainer"]["intervals"]["steps_per_s"] > 0
    # issue 45: no warmup_steps given, yet the Trainer's start-up (the first interval) is not steady, and the
    # ranks row shows the steady line's rate over the same window
    assert intervals[0].get("warmup") and rep["steady"]["roles"]["trainer"]["intervals"]["window"].startswith("steady")
    (row,) = rep["ranks"]["ranks"]
    assert row["tokens_per_s"] == rep["steady"]["roles"]["trainer"]["intervals"]["tokens_per_s"]
    hot = rep["hot_frames"]
    assert hot["threads"] and hot["profiler_threads"], hot   # py-spy sampled both
    assert not any(t["thread"].startswith("profiler.") for t in hot["threads"])
    assert {"profiler.collector", "profiler.stacks"} <= {t["thread"] for t in hot["profiler_threads"]}
    assert report_cli.main(["hotspots", str(run)]) == 0
    text = capsys.readouterr().out
    assert "trainer.step" in text and "the profiler's own threads" in text
    assert_no_pipeline_noise(text)
