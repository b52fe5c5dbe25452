"""LitLLM inside a real Lightning Trainer: what it logs, the batches it accepts, and its train and val losses. (How it
builds the optimizer is in test_module_optimizer.py, its checkpoints in test_module_checkpoints.py.)"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_dtrain.module import LitLLM
from tests.unit._module_helpers import fit, tiny_lit, window_loader


class MicroLosses(L.Callback):
    """Each optimizer step's micro-batch losses, as Lightning hands them to backward (divided by A)."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[float]] = {}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.by_step.setdefault(trainer.global_step, []).append(float(loss))


def test_train_loss_under_accumulation_is_the_mean_over_the_steps_micro_batches(tmp_path: Path) -> None:
    """``train/loss`` of an optimizer step with ``accumulate_grad_batches=A`` is the loss of the whole step (the mean
    over its A micro-batches, what the gradient is of), not the loss of its last micro-batch."""
    micro = MicroLosses()
    rows = fit(tiny_lit(), tmp_path, steps=3, accumulate=4, callbacks=[micro])
    logged = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert sorted(logged) == [0, 1, 2]
    for step, value in logged.items():
        losses = micro.by_step[step]
        assert len(losses) == 4
        assert value == pytest.approx(sum(losses), rel=1e-5)  # each is divided by A = 4
        assert abs(value - 4 * losses[-1]) > 1e-4  # the last micro-batch alone differs here


@pytest.mark.parametrize(
    "batch, got",
    [
        ((torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)), "tuple"),
        (torch.zeros(2, 8, dtype=torch.long), "Tensor"),
        ([{"input_ids": torch.zeros(2, 8, dtype=torch.long)}], "list"),
    ],
)
def test_a_batch_that_is_not_a_dict_is_an_error_naming_its_type_and_the_contract(batch, got) -> None:
    """A tuple ``(x, y)`` (the usual DataLoader batch), a bare tensor, or a list of dicts (what Lightning hands
    over when ``fit`` is given a list of batches) was a RuntimeError from inside ``in`` or ``sorted``."""
    with pytest.raises(TypeError, match=rf"LitLLM.*'input_ids'.*'labels'.*a dict.*got a {got}$"):
        tiny_lit().validation_step(batch, 0)


class GradNorms(L.Callback):
    """The total gradient norm of each step as the optimizer is about to see it, before Lightning clips."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.by_step[trainer.global_step] = float(torch.cat(grads).double().norm())


@pytest.mark.parametrize("clip", [0.01, None])
def test_the_gradient_norm_before_clipping_is_logged_at_the_loss_steps(tmp_path: Path, clip) -> None:
    """``train/grad_norm`` is the total norm the step's clipping measured (before clipping, so above a clip of 0.01),
    written at the steps ``train/loss`` is written (every 2nd here); with clipping off it is still measured."""
    probe = GradNorms()
    rows = fit(tiny_lit(), tmp_path, steps=6, accumulate=2, callbacks=[probe], gradient_clip_val=clip,
               log_every_n_steps=2)
    norms = {int(r["step"]): float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")}
    losses = {int(r["step"]) for r in rows if r.get("train/loss")}
    assert sorted(norms) == sorted(losses) == [1, 3, 5]
    for step, norm in norms.items():
        assert norm == pytest.approx(probe.by_step[step], rel=1e-5)
        assert norm > 0.05  # the norm before the clip to 0.01
    assert len(probe.by_step) == 6


@pytest.mark.parametrize(
    "key, bad, named",
    [
        ("input_ids", 300, r"'input_ids' holds token id 300, outside the model's vocabulary \[0, 257\) \(set model"),
        ("labels", 257, r"'labels' holds token id 257, outside the model's vocabulary \[0, 257\) \(set model"),
        ("labels", -100, r"'labels' holds token id -100, .*masks no tokens.*-100 is no ignore index"),
    ],
)
def test_a_token_id_outside_the_vocabulary_is_named_in_training_and_validation(tmp_path, key, bad, named) -> None:
    """A tokenizer larger than the model's vocabulary was torch's "index out of range in self" (CPU) or a
    device-side assert (GPU); a label -100 (an ignore index elsewhere) trained silently as a token of loss 0."""
    batches = window_loader(4)
    batches[0][key][1, 3] = bad
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=named):
        trainer.fit(tiny_lit(), train_dataloaders=DataLoader(batches, batch_size=None))
    with pytest.raises(ValueError, match=named):
        trainer.validate(tiny_lit(), dataloaders=DataLoader(batches, batch_size=None), verbose=False)
    # the check reads the first batch of each loop only, and in-range batches train as before
    module = tiny_lit()
    rows = fit(module, tmp_path / "ok", steps=2, accumulate=1)
    assert module._ids_checked and sum(1 for r in rows if r.get("train/loss")) == 2


def test_a_label_minus_100_after_the_checked_first_batch_fails_instead_of_counting_as_loss_0() -> None:
    """Only the first batch of a loop is range-checked; cross_entropy's default ignore_index then made a later -100
    label a token of loss 0 in the mean, silently (a loss lowered by 1/(B*T) of a token's loss per label)."""
    module = tiny_lit()
    module.log = lambda *a, **k: None  # no trainer attached
    first, later = window_loader(2)
    module.training_step(first, 0)
    assert module._ids_checked  # the next batch is not range-checked
    later["labels"][1, 3] = -100
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        module.training_step(later, 1)
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        module.validation_step(later, 1)


def test_flops_per_batch_follows_the_batch_being_measured_train_or_validation(tmp_path: Path) -> None:
    """The ThroughputMonitor reads ``flops_per_batch`` after every train and validation batch. It was the estimate of
    the first train batch, forward + backward, also for validation batches: validate/device/flops_per_sec (and MFU)
    counted the backward pass validation does not run, at the train batch size (val batches are 4x larger by
    default). Validation batches now count their own forward FLOPs."""
    from lit_dtrain.callbacks import token_throughput_monitor
    from lit_dtrain.module import estimate_train_flops

    module = tiny_lit()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, val_check_interval=3, num_sanity_val_steps=0,
        callbacks=[token_throughput_monitor(window_size=2)], logger=CSVLogger(str(tmp_path), name="csv", version=0),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    train = DataLoader(window_loader(3, batch_size=2), batch_size=None)
    val = DataLoader(window_loader(4, batch_size=8), batch_size=None)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))

    def flops_per_batch(stage: str) -> float:
        row = [r for r in rows if r.get(f"{stage}/device/flops_per_sec")][-1]
        return float(row[f"{stage}/device/flops_per_sec"]) / float(row[f"{stage}/device/batches_per_sec"])

    assert flops_per_batch("train") == pytest.approx(estimate_train_flops(module.model, 2, 16), rel=1e-6)
    assert flops_per_batch("validate") == pytest.approx(estimate_train_flops(module.model, 8, 16) / 3, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_val_loss_sums_stay_fp32_or_wider_when_the_precision_casts_the_module(dtype) -> None:
    """bf16-true (and 16-true) convert the module with ``.to(dtype)``, which cast the val-loss metric's states: the
    sums were accumulated in bf16 and val/loss was a bf16 number (5.4688 for a mean of 5.4805 in a real fit). They
    stay fp32 now (fp64 under 64-true)."""
    lit = tiny_lit(val_names=["a", "b"]).to(dtype)
    token_loss = torch.linspace(1.0, 1.8, 4096).view(16, 256).to(dtype)
    for metric in (lit.val_loss, lit.val_loss_by_source[1]):
        assert metric.mean_value.dtype == metric.weight.dtype == (torch.float64 if dtype == torch.float64 else
                                                                  torch.float32)
        metric.update(token_loss, torch.ones_like(token_loss))
        assert float(metric.compute()) == pytest.approx(float(token_loss.double().mean()), rel=1e-6)


def test_val_loss_is_nan_when_any_window_is_nan() -> None:
    """torchmetrics' MeanMetric drops NaN values by default (with a warning): a model whose logits overflowed on some
    validation windows reported the mean of the others, a healthy-looking val/loss that ModelCheckpoint could keep as
    the best. A NaN token loss now makes val/loss (and the source's) NaN."""
    lit = tiny_lit(val_names=["a", "b"])
    lit.model.register_forward_hook(lambda module, args, out: out.index_fill(0, torch.tensor([0]), float("nan")))
    batch = window_loader(1, batch_size=3)[0]
    with torch.no_grad():
        lit.validation_step(batch, 0, dataloader_idx=1)
    assert torch.isnan(lit.val_loss.compute())
    assert torch.isnan(lit.val_loss_by_source[1].compute())


def test_the_loss_of_a_float64_model_is_computed_in_float64() -> None:
    """precision=64-true: the token loss was cast down to fp32 (logits.float()), silently."""
    lit = tiny_lit()
    lit.model.double()
    batch = window_loader(1)[0]
    token_loss = lit._token_loss(batch)
    assert token_loss.dtype == torch.float64
    with torch.no_grad():
        logits = lit.model(batch["input_ids"])
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    torch.testing.assert_close(token_loss.detach().flatten(), want, rtol=1e-13, atol=0)


class StepLossSeen(L.Callback):
    """At each batch end: the step's loss from its output, and ``train/loss`` as callbacks, the progress bar and the
    loggers' next write see it."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append((float(outputs["loss"]), float(trainer.callback_metrics["train/loss"]),
                          trainer.progress_bar_metrics["train/loss"], float(trainer.logged_metrics["train/loss"])))


def test_train_loss_reaches_callbacks_bar_and_loggers_every_step_with_one_self_log_per_epoch(tmp_path, monkeypatch):
    """``train/loss`` is registered through ``self.log`` once per epoch, then fed to Lightning's stored result
    directly (``module_metrics.log_every_step``: ``self.log`` cost ~0.7 ms of CPU a step); every step's value, in
    ``callback_metrics``, the progress bar and the CSV rows, is that step's loss, across epochs and validations."""
    calls = []
    monkeypatch.setattr(LitLLM, "log", lambda self, name, *a, **k: calls.append(name) or L.LightningModule.log(
        self, name, *a, **k))
    seen = StepLossSeen()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, log_every_n_steps=2, val_check_interval=2,
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), callbacks=[seen],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    batches = DataLoader(window_loader(4), batch_size=None)
    trainer.fit(tiny_lit(), train_dataloaders=batches, val_dataloaders=DataLoader(window_loader(1), batch_size=None))
    assert calls.count("train/loss") == 2  # the first step of each epoch
    assert len(seen.rows) == 8
    for loss, callback, bar, logged in seen.rows:
        assert callback == logged == loss and bar == pytest.approx(loss, abs=0)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert rows == {step: seen.rows[step][0] for step in (1, 3, 5, 7)}


def test_a_steps_first_micro_batch_gives_its_loss_as_the_mean_without_a_tensor_op() -> None:
    """The step's mean loss costs no tensor op (kernel launch) at a step's first micro-batch, the only one without
    accumulation: it was zeros + loss, then / 1 (three ops a step, ~0.13 ms of host CPU); later ones still average."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    module = tiny_lit()
    module._trainer = SimpleNamespace(global_step=3)
    first = torch.tensor(2.0)
    with CountOps():
        assert module._step_mean_loss(first) is first
    assert ops == []
    assert float(module._step_mean_loss(torch.tensor(4.0))) == 3.0  # step 3's second micro-batch: the mean
    module._trainer.global_step = 4
    assert float(module._step_mean_loss(torch.tensor(5.0))) == 5.0
