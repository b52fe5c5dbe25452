"""Every scalar a run writes, with every callback on and gradient accumulation, checked on its step axis.

``train()`` runs once per logger (TensorBoard, CSV) with ``callbacks=[default, loss_spike, adaptive_grad_clip,
optimizer_diagnostics, selective_ckpt, fourier_sampler]``, the FourierSampler, ``accumulate_grad_batches=2`` and
``log_every_n_steps=2``. Then, for every scalar tag the logger holds:

- its steps strictly increase (no step written twice, none going backwards);
- every value is finite;
- a per-step tag is written at Lightning's cadence, the steps ``k`` with ``(k + 1) % log_every_n_steps == 0``, at
  each of them from its first row on (a tag may start late: ``grad_clip/threshold`` and ``spike/loss_z`` after their
  warmup), except that a tag of the step's gradient or update has no row at a step whose grads were dropped (a NaN
  loss at step 5 here, which ``LossSpikeMonitor`` skips);
- a per-validation tag (``val/*``, ``validate/*``) is written at exactly the steps of ``val/loss``.

Defects of this kind found: ``train/grad_norm`` at a dropped step repeated the previous logged step's norm
(``LitLLM`` logged it through ``self.log``, and Lightning writes the last value a name was given); Lightning's
``LearningRateMonitor`` wrote every ``lr-*`` row once per micro-batch (fixed by ``OncePerStepLRMonitor``), and
Lightning's ``ThroughputMonitor`` wrote ``validate/*`` under its own count of validation batches, going backwards
among the training steps (fixed in ``token_throughput_monitor``).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from lit_dtrain.train import train
from tests.conftest import compose_cfg, load_script
from tests.unit.test_docs_references import undocumented_tags

LOG_EVERY = 2
MAX_STEPS = 9
VAL_EVERY = 3
DROPPED_STEP = 5

# Tags that describe a step's gradient or update: a step whose grads were dropped has no row of them.
OF_THE_UPDATE = ("train/grad_norm", "grad_clip/", "optim/", "fourier/")

OVERRIDES = [
    "model=nano",
    "data=textfiles",
    "data.batch_size=4",
    "data.max_val_windows=8",
    "data.val_batch_size=1",  # two batches per validation (the corpus has two val windows)
    "data.progress=false",
    "data/sampler=fourier",
    "data.sampler.step_unit=1",  # stage boundaries at steps 5 and 20: the multiplier and the bands change in the run
    f"trainer.max_steps={MAX_STEPS}",
    f"trainer.val_check_interval={VAL_EVERY}",  # validations after steps 3, 6, 9, and train()'s final one
    f"trainer.log_every_n_steps={LOG_EVERY}",
    "trainer.accumulate_grad_batches=2",
    "trainer.gradient_clip_val=null",  # AdaptiveGradClip clips instead
    "trainer.accelerator=cpu",
    "trainer.enable_model_summary=false",
    "trainer.enable_progress_bar=false",
    "scheduler.warmup_steps=1",
    "sample.max_new_tokens=0",
    "callbacks=[default,loss_spike,adaptive_grad_clip,optimizer_diagnostics,selective_ckpt,fourier_sampler]",
    "callbacks.progress_bar=null",
    "callbacks.throughput.window_size=2",  # tokens/s from the second step on, not after 50
    "callbacks.loss_spike.warmup_steps=2",  # spike/loss_z from step 2 on
    "callbacks.adaptive_grad_clip.warmup_steps=2",  # grad_clip/threshold from step 2 on
    f"callbacks.optimizer_diagnostics.every_n_steps={LOG_EVERY}",  # its own cadence, here Lightning's
    # a NaN loss at step 5, a logged step: LossSpikeMonitor drops the step's grads (its `skip`)
    "+callbacks.fault._target_=tests.faults.PoisonLossAtStep",
    f"+callbacks.fault.step={DROPPED_STEP}",
]

# Tags written by Lightning itself that break the rules, and why. Nothing of lit_dtrain's may be listed here.
EXCLUDED = {
    # Lightning's logger connector adds `epoch` to every write that does not name its step (the training step's
    # metrics, ThroughputMonitor's training rows, each validation's metrics and validate/* rows): two to four rows at
    # one step whenever those meet (lightning 2.6, _LoggerConnector.log_metrics).
    "epoch",
}

# One family of tags from each part of the run, so that a part that stops logging fails the test.
FAMILIES = ("train/loss", "train/grad_norm", "train/device/items_per_sec", "lr-AdamW/", "fourier/", "grad_clip/",
            "spike/", "optim/", "val/loss", "validate/device/items_per_sec", "memory/rss_mib", "memory/peak_rss_mib")


def _tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # the whole folder, as TensorBoard reads it: Lightning closes the writer when fit ends, and train()'s final
    # validation opens a second event file
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _csv_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    tags: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name != "step" and value != "":
                    tags.setdefault(name, []).append((int(row["step"]), float(value)))
    return tags


def axis_violations(tags: dict[str, list[tuple[int, float]]], log_every: int, last_step: int,
                    dropped: tuple[int, ...] = ()) -> list[str]:
    """Every broken rule, one line each, for the tags outside ``EXCLUDED`` (see the module docstring); ``dropped``:
    the steps whose grads were dropped."""
    val_steps = [step for step, _ in tags["val/loss"]]
    cadence = [k for k in range(last_step + 1) if (k + 1) % log_every == 0]
    problems = []
    for tag, rows in sorted(tags.items()):
        if tag in EXCLUDED:
            continue
        steps = [step for step, _ in rows]
        if any(later <= earlier for earlier, later in zip(steps, steps[1:])):
            problems.append(f"{tag}: steps do not strictly increase: {steps}")
        bad = [(step, value) for step, value in rows if not math.isfinite(value)]
        if bad:
            problems.append(f"{tag}: non-finite values {bad}")
        if tag.startswith(("val/", "validate/")):
            if steps != val_steps:
                problems.append(f"{tag}: steps {steps}, not those of val/loss {val_steps}")
            continue
        expected = [k for k in cadence if steps and k >= steps[0]]
        if tag.startswith(OF_THE_UPDATE) or tag.endswith("-effective"):  # (lr-*-effective: the LR the update used)
            expected = [k for k in expected if k not in dropped]
        if not steps or steps != expected:
            problems.append(f"{tag}: steps {steps}, not the cadence steps {expected} from its first row on")
    return problems


def test_axis_violations_are_found():
    """The checker itself: each kind of defect is named (a checker that finds nothing would pass any run)."""
    good = {
        "val/loss": [(2, 4.0), (5, 3.0)],
        "train/loss": [(1, 4.0), (3, 3.5), (5, 3.0)],
        "spike/loss_z": [(3, 0.5), (5, 0.1)],  # starts late (its warmup)
        "train/grad_norm": [(1, 2.0), (5, 2.0)],  # none at the dropped step 3
        "epoch": [(1, 0), (1, 0)],  # excluded
    }
    assert axis_violations(good, 2, 5, dropped=(3,)) == []
    bad = {
        "val/loss": [(2, 4.0), (5, 3.0)],
        "lr-SGD": [(1, 0.1), (1, 0.1), (3, 0.1), (3, 0.1)],  # Lightning's LearningRateMonitor under accumulation
        "validate/time": [(2, 1.0), (4, 1.0)],  # Lightning's ThroughputMonitor's count of validation batches
        "train/loss": [(1, 4.0), (3, float("nan")), (5, 3.0)],
        "spike/count": [(1, 0.0), (4, 1.0), (5, 1.0)],  # off the cadence
        "spike/loss_z": [(1, 0.5), (5, 0.1)],  # a gap: no row at step 3
        "train/grad_norm": [(1, 2.0), (3, 2.0), (5, 2.0)],  # a row at the dropped step 3
    }
    assert axis_violations(bad, 2, 5, dropped=(3,)) == [
        "lr-SGD: steps do not strictly increase: [1, 1, 3, 3]",
        "lr-SGD: steps [1, 1, 3, 3], not the cadence steps [1, 3, 5] from its first row on",
        "spike/count: steps [1, 4, 5], not the cadence steps [1, 3, 5] from its first row on",
        "spike/loss_z: steps [1, 5], not the cadence steps [1, 3, 5] from its first row on",
        "train/grad_norm: steps [1, 3, 5], not the cadence steps [1, 5] from its first row on",
        "train/loss: non-finite values [(3, nan)]",
        "validate/time: steps [2, 4], not those of val/loss [2, 5]",
    ]


@pytest.mark.parametrize("logger", ["tensorboard", "csv"])
def test_every_scalar_is_finite_once_per_step_on_its_cadence(tmp_path, corpus, logger):
    # train() on train.py's composed config, in this process: a train.py process cost ~5 s of imports, and the
    # scalars are train()'s
    run_dir = tmp_path / "outputs" / "runs" / "axes"
    train(compose_cfg([*OVERRIDES, f"data.sources.0.paths=[{corpus}]", f"logger={logger}"], run_dir, tiny=False))
    tags = (_tensorboard_scalars if logger == "tensorboard" else _csv_scalars)(run_dir)

    missing = [family for family in FAMILIES if not any(tag.startswith(family) for tag in tags)]
    assert missing == [], f"nothing logged for {missing}; tags: {sorted(tags)}"
    # validations after steps 3, 6 and 9 (at their 0-based index), and train()'s final one at global_step
    assert [step for step, _ in tags["val/loss"]] == [2, 5, 8, 9]
    assert [step for step, _ in tags["train/loss"]] == [1, 3, 5, 7]
    problems = axis_violations(tags, LOG_EVERY, MAX_STEPS - 1, dropped=(DROPPED_STEP,))
    assert not problems, "\n".join(problems)
    # compare_runs.py ranks each tag in its own direction: every tag logged here must be in its table
    compare_runs = load_script("compare_runs", "compare_runs")
    assert [tag for tag in tags if not compare_runs.listed_direction(tag)[0]] == []
    assert undocumented_tags(tags) == []  # and each is named in the docs (README.md, docs/*.md)
    # the premise: step 5 was dropped, and it was logged by the tags that describe more than its update
    events = [json.loads(line) for line in (run_dir / "spikes.jsonl").read_text().splitlines()]
    assert [(e["step"], e["actions"]) for e in events] == [(DROPPED_STEP, ["log", "skip"])]
    assert (DROPPED_STEP, 1.0) in tags["spike/count"]
