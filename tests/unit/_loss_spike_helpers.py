"""Helpers shared by the test_loss_spike*.py files (and other callbacks' tests): a tiny module, data and trainer,
fault injection, state comparison."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.conftest import make_corpus


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest single-threaded, especially when CPU cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------------
# Lightning integration: a tiny model on a tiny corpus
# ---------------------------------------------------------------------------------------------------------------


def make_module(seed: int = 0):
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from lit_dtrain.schedules import cosine_scheduler

    torch.manual_seed(seed)
    model = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32))
    return LitLLM(model, optimizer=partial(adamw, lr=3e-3), scheduler=partial(cosine_scheduler, total_steps=40,
                                                                              warmup_steps=2))


def make_data(tmp_path: Path, batch_size: int = 4, n_files: int = 6, size: int = 2000):
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.data.corpus import CorpusSource

    corpus = make_corpus(tmp_path / "corpus", n_files=n_files, size=size)
    return LMDataModule(sources=[CorpusSource(name="c", kind="files", paths=[str(corpus)])], block_size=32,
                        batch_size=batch_size, cache_dir=str(tmp_path / "cache"), progress=False, max_val_windows=4)


def make_trainer(tmp_path: Path, callbacks, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(tmp_path), limit_val_batches=0, gradient_clip_val=1.0)


def fit_with_tensorboard(tmp_path: Path, callbacks, max_steps: int, log_every_n_steps: int):
    """Fit ``make_module()`` with a TensorBoard logger; the event files' EventAccumulator, loaded."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks,
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0),
                        log_every_n_steps=log_every_n_steps, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=0)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


class Inject(L.Callback):
    """At the given steps, multiplies the logits (finite spike) or makes them NaN."""

    def __init__(self, steps: dict[int, str]) -> None:
        self.steps, self._handle = steps, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kind = self.steps.get(trainer.global_step)
        if kind is not None:
            scale = float("nan") if kind == "nan" else 30.0
            self._handle = pl_module.model.register_forward_hook(lambda m, i, out: out * scale)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class InjectAt(Inject):
    """:class:`Inject` with list arguments, for Hydra overrides."""

    def __init__(self, finite: list[int] = (), nan: list[int] = ()) -> None:
        super().__init__({**{int(s): "finite" for s in finite}, **{int(s): "nan" for s in nan}})


def full_state(trainer: L.Trainer) -> dict:
    opt = trainer.optimizers[0]
    return {
        "params": {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()},
        "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())},
        "lrs": [g["lr"] for g in opt.param_groups],
        "sched": dict(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
    }


def assert_identical(a: dict, b: dict, schedule: bool = True) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        for k in a["opt"][i]:
            assert torch.equal(a["opt"][i][k], b["opt"][i][k]), (i, k)
    if schedule:
        assert a["lrs"] == b["lrs"]
        assert a["sched"]["last_epoch"] == b["sched"]["last_epoch"]
        assert a["sched"]["_last_lr"] == b["sched"]["_last_lr"]


def assert_schedule_follows_the_step(probe) -> None:
    """Skips and rollbacks do not hold the LR schedule back: after ``s`` steps it has taken ``s`` steps, and
    every param group runs at the scheduler's LR (so a WSD decay always ends on its last value)."""
    for done, state in probe.after.items():
        assert state["sched"]["last_epoch"] == done, done
        assert state["lrs"] == state["sched"]["_last_lr"], done


class Probe(L.Callback):
    """Full training state at the end of every step, and the sample indices of every batch."""

    def __init__(self, full: bool = True) -> None:
        self.full = full
        self.after: dict[int, dict] = {}
        self.indices: dict[int, list[int]] = {}

    def on_train_start(self, trainer, pl_module):
        if self.full:
            self.after[trainer.global_step] = full_state(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.indices[trainer.global_step] = batch["index"].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.full:
            self.after[trainer.global_step] = full_state(trainer)  # keyed by steps completed


class LrProbe(L.Callback):
    """The LR each step used (``applied``, at the optimizer step) and its scheduler's LR (``scheduled``, after it)."""

    def __init__(self):
        self.applied, self.scheduled = {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.applied[trainer.global_step] = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scheduled[trainer.global_step] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
