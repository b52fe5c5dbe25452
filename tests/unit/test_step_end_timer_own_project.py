"""``lit_dtrain.callbacks.StepEndTimer`` in a project of one's own: Lightning's ``Trainer(max_time=...)`` stopped one
with ``accumulate_grad_batches=2`` at micro-batch 3, mid-step; its ``last.ckpt`` held a step half accumulated and the
resume ended 0.038 off the straight run's weights. ``StepEndTimer`` waits for the step's end: the resume is bitwise."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from torch import nn


class _LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(256, 8), nn.Linear(8, 256)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2)


class _TimeUpAtMicroBatch3(L.Callback):
    """Uses up the timer's duration in micro-batch 3 (the first of step 2), as a slow batch would."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == 2:
            next(c for c in trainer.callbacks if isinstance(c, Timer))._offset = 1e6


def _fit(root: Path, run: str, max_steps: int, callbacks=(), ckpt_path=None) -> tuple[L.Trainer, _LM]:
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.datamodule import LMDataModule

    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(100)))
    data = LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], block_size=8,
                        batch_size=2, val_fraction=0.1, cache_dir=str(root / "cache"), progress=False)
    trainer = L.Trainer(max_steps=max_steps, accumulate_grad_batches=2, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        callbacks=[ModelCheckpoint(dirpath=root / run, save_last=True), *callbacks])
    module = _LM()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module


def test_a_step_end_timer_stop_resumes_bitwise_in_a_project_of_ones_own(tmp_path: Path) -> None:
    from lit_dtrain.callbacks import StepEndTimer

    _, straight = _fit(tmp_path, "straight", 3)
    stopped, _ = _fit(tmp_path, "stopped", 3, [StepEndTimer(duration="00:01:00:00"), _TimeUpAtMicroBatch3()])
    assert stopped.global_step == 2  # Lightning's Timer: 1, mid-step 2
    last = torch.load(tmp_path / "stopped" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 2
    assert last["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 4  # whole steps (3 before)
    _, resumed = _fit(tmp_path, "stopped", 3, ckpt_path=str(tmp_path / "stopped" / "last.ckpt"))
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)  # (0.038 off after Lightning's Timer's stop)


def test_a_step_end_timer_needs_its_duration_and_wins_over_trainer_max_time() -> None:
    from lit_dtrain.callbacks import StepEndTimer

    with pytest.raises(ValueError, match=r"StepEndTimer needs a duration .* ignores Trainer\(max_time=...\)"):
        StepEndTimer(duration=None)
    ours = StepEndTimer(duration="00:00:00:05")
    trainer = L.Trainer(max_time="00:01:00:00", callbacks=[ours], logger=False, enable_checkpointing=False)
    assert [c for c in trainer.callbacks if isinstance(c, Timer)] == [ours] and ours._duration == 5.0


def test_the_docs_quote_lightnings_lines_about_a_second_timer_as_lightning_words_them(caplog, tmp_path: Path) -> None:
    """docs/callbacks_in_your_project.md quotes Lightning's info line for ``max_time`` beside a ``StepEndTimer`` and its
    error for two timers: they read ``Ignoring Trainer(max_time=...)`` and ``of type StepEndTimer`` where Lightning
    writes ``Trainer(max_time=...)`` in backticks and names the later callback's class (``Timer`` after ours)."""
    from lit_dtrain.callbacks import StepEndTimer

    doc = (Path(__file__).resolve().parents[2] / "docs" / "callbacks_in_your_project.md").read_text()
    with caplog.at_level("INFO"):
        L.Trainer(max_time="00:01:00:00", callbacks=[StepEndTimer(duration="00:00:00:05")], logger=False)
    info = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Ignoring"))
    assert f"info line ``{info}``" in doc
    with pytest.raises(RuntimeError) as error:  # when the Trainer is built
        L.Trainer(callbacks=[StepEndTimer(duration="00:00:00:05"), Timer()], logger=False, default_root_dir=tmp_path)
    first = str(error.value).split(". ")[0]
    assert f"``RuntimeError: {first}. ...``" in doc


@pytest.mark.parametrize(("timer", "accumulate", "warned"), [
    ("max_time", 2, True), ("max_time", 1, False), ("max_time", {0: 1, 1: 4}, True), ("ours", 2, False),
    ("measuring", 2, False), ("per_epoch", 2, False),  # Timer() stops nothing; interval="epoch" stops at its end
])
def test_preemption_checkpoint_warns_of_lightnings_timer_stopping_mid_step(tmp_path: Path, timer, accumulate,
                                                                           warned) -> None:
    """With ``Trainer(max_time=...)`` and ``accumulate_grad_batches=2`` a project's fit stopped at micro-batch 3 without
    a word; beside ``PreemptionCheckpoint`` (whose saves wait for the step's end) it now says so, naming the fix."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lit_dtrain.callbacks import PreemptionCheckpoint, StepEndTimer

    callbacks = [PreemptionCheckpoint(dirpath=str(tmp_path))]
    kwargs = {"max_time": "00:01:00:00"} if timer == "max_time" else {}
    callbacks += [StepEndTimer(duration="00:01:00:00")] if timer == "ours" else []
    callbacks += [Timer()] if timer == "measuring" else []
    callbacks += [Timer(duration="00:01:00:00", interval="epoch")] if timer == "per_epoch" else []
    if isinstance(accumulate, dict):
        callbacks.append(GradientAccumulationScheduler(accumulate))
    else:
        kwargs["accumulate_grad_batches"] = accumulate
    trainer = L.Trainer(callbacks=callbacks, logger=False, enable_checkpointing=False, **kwargs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        callbacks[0].setup(trainer, None, "fit")
    said = [str(w.message) for w in record if "PreemptionCheckpoint saves" in str(w.message)]
    assert len(said) == (1 if warned else 0)
    if warned:
        assert re.search(r"Lightning's Timer .* accumulate_grad_batches=[24] it stops between .*"
                         r"callbacks.StepEndTimer\(duration=...\)\] in place of max_time", said[0])
