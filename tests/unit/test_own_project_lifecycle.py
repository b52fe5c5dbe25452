"""lit_dtrain's callbacks across the lifecycles of a Lightning project of one's own: the same callback objects
given to a second Trainer (a sweep loop, a next stage), which must start as fresh ones do."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.callbacks import ModelCheckpoint, StepEndTimer


class Regression(L.LightningModule):
    """A linear regression on 32 fixed samples, validated on the same data."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.lr = torch.nn.Linear(4, 1), lr

    def _loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader() -> DataLoader:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit(root: Path, callbacks: list, module: L.LightningModule, **trainer_kwargs) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(root), callbacks=callbacks, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=loader(), val_dataloaders=loader())
    return trainer


def test_a_model_checkpoint_reused_by_a_second_trainer_writes_into_that_trainers_run_dir(tmp_path: Path) -> None:
    """A sweep loop over the learning rate with one ModelCheckpoint(monitor=..., save_last=True) built before it:
    Lightning kept the first Trainer's dirpath and top-k, so the second run (lr 0.1) wrote its files into the first
    run's checkpoints/, over its epoch=0-step=8.ckpt (the same name), and its own run dir got none. Now it starts as a
    fresh object: each run dir holds its own files, with its own run's weights and best score."""
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    runs = {}
    for lr in (1e-3, 1e-1):
        root = tmp_path / f"lr{lr}"
        trainer = fit(root, [checkpoint], Regression(lr), max_steps=8, val_check_interval=4)
        runs[lr] = (root / "checkpoints", [p.detach().clone() for p in trainer.lightning_module.parameters()])
        assert Path(checkpoint.best_model_path).parent == root / "checkpoints"
        assert float(checkpoint.best_model_score) == float(trainer.callback_metrics["val_loss"])
    for directory, weights in runs.values():
        assert sorted(p.name for p in directory.iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
        saved = torch.load(directory / "epoch=0-step=8.ckpt", weights_only=True)["state_dict"]
        assert all(torch.equal(saved[f"net.{n}"], w) for n, w in zip(("weight", "bias"), weights))


def test_a_reused_model_checkpoint_finds_last_in_the_new_trainers_run_dir(tmp_path: Path) -> None:
    """A sweep loop that passes ckpt_path="last" to every fit (set and forget, for preemption): Lightning looks for
    last.ckpt before setup, in the dirpath the object kept from the first Trainer, so the second run (lr 0.1, its own
    run dir empty) resumed the first run's last.ckpt at step 8 and trained no step (its weights the first run's). Now
    it looks in the new Trainer's run dir: nothing there, the second run trains its 8 steps from scratch."""
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    steps = {}
    for lr in (1e-3, 1e-1):
        root = tmp_path / f"lr{lr}"
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(root), callbacks=[checkpoint], max_steps=8, val_check_interval=4)
        module, start = Regression(lr), [p.detach().clone() for p in Regression(lr).parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_dataloaders=loader(), val_dataloaders=loader(), ckpt_path="last")
        steps[lr] = (trainer.global_step, sorted(p.name for p in root.rglob("*.ckpt")))
        trained = [p.detach().clone() for p in module.parameters()]
        fresh = fit(tmp_path / f"fresh{lr}", [ModelCheckpoint(monitor="val_loss")], Regression(lr), max_steps=8,
                    val_check_interval=4)
        assert all(torch.equal(a, b) for a, b in zip(trained, fresh.lightning_module.parameters()))
        assert not all(torch.equal(a, b) for a, b in zip(trained, start))
    assert steps == {lr: (8, ["epoch=0-step=8.ckpt", "last.ckpt"]) for lr in (1e-3, 1e-1)}


def test_a_model_checkpoint_refitted_by_the_same_trainer_keeps_its_files(tmp_path: Path) -> None:
    """The same Trainer fitted again (max_steps raised) goes on: the same dirpath, its top-k ranked with the first
    fit's files (save_top_k=1 keeps one step file of the two fits)."""
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    trainer = fit(tmp_path, [checkpoint], Regression(), max_steps=4, val_check_interval=4)
    first = checkpoint.best_model_path
    trainer.fit_loop.epoch_loop.max_steps = 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(trainer.lightning_module, train_dataloaders=loader(), val_dataloaders=loader())
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert Path(first).name == "epoch=0-step=4.ckpt" and files == ["epoch=1-step=8.ckpt", "last.ckpt"]


class Clock(L.Callback):
    """Lightning's Timer's clock, one second a training batch (put before the timer in the callbacks)."""

    def __init__(self, monkeypatch) -> None:
        import lightning.pytorch.callbacks.timer as timer_module

        self.now = 0.0
        monkeypatch.setattr(timer_module, "time", type("FakeTime", (), {"monotonic": staticmethod(lambda: self.now)}))

    def on_train_batch_end(self, *args) -> None:
        self.now += 1.0


@pytest.mark.parametrize("same_trainer", [False, True])
def test_a_step_end_timer_fitted_again_stops_at_its_duration(tmp_path: Path, monkeypatch, same_trainer) -> None:
    """A 3 s StepEndTimer whose first fit took 2 steps of 1 s. Lightning's Timer kept that fit's end time, so the next
    fit's elapsed time (that end minus its own start) stayed negative: a new Trainer given the same object, and the
    same Trainer fitted again, trained all 20 steps. Now a new Trainer counts from 0 s, as a fresh timer (3 steps), and
    the same Trainer goes on from its first fit's 2 s (1 step more)."""
    clock, timer = Clock(monkeypatch), StepEndTimer(duration={"seconds": 3}, verbose=False)
    trainer = fit(tmp_path / "a", [clock, timer], Regression(), max_steps=2, enable_checkpointing=False)
    assert trainer.global_step == 2 and timer.time_elapsed() == 2.0
    if same_trainer:
        trainer.fit_loop.epoch_loop.max_steps = 20
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(trainer.lightning_module, train_dataloaders=loader())
        assert trainer.global_step == 3 and timer.time_elapsed() == 3.0
    else:
        trainer = fit(tmp_path / "b", [clock, timer], Regression(), max_steps=20, enable_checkpointing=False)
        fresh = fit(tmp_path / "c", [clock, StepEndTimer(duration={"seconds": 3})], Regression(), max_steps=20,
                    enable_checkpointing=False)
        assert trainer.global_step == fresh.global_step == 3 and timer.time_elapsed() == 3.0


def test_a_validation_of_a_checkpoint_between_two_fits_leaves_the_step_end_timers_count(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """trainer.validate(ckpt_path=<step 1's file>) between two fits of the same Trainer: Lightning loads the timer's
    state there too, so the second fit went on from that file's 1 s, not the first fit's 2 s (and stopped a step
    late). The timer keeps the count of the fit it serves, as the other callbacks do."""
    clock, timer = Clock(monkeypatch), StepEndTimer(duration={"seconds": 3}, verbose=False)
    saves = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)
    trainer = fit(tmp_path, [clock, timer, saves], Regression(), max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(trainer.lightning_module, loader(), ckpt_path=tmp_path / "ck" / "epoch=0-step=1.ckpt",
                         verbose=False)
        trainer.fit_loop.epoch_loop.max_steps = 20
        trainer.fit(trainer.lightning_module, train_dataloaders=loader())
    assert trainer.global_step == 3 and timer.time_elapsed() == 3.0


class RaiseOnce(L.Callback):
    """Raises in the batch end of optimizer step ``step`` of the first fit only (an error the user then fixes)."""

    def __init__(self, step: int) -> None:
        self.step, self.armed = step, True

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.armed and trainer.global_step == self.step:
            self.armed = False
            raise RuntimeError("the user's error")


def test_a_step_end_timer_refitted_after_an_error_counts_the_fit_that_raised(tmp_path: Path, monkeypatch) -> None:
    """A 3 s StepEndTimer whose fit raised after 2 steps of 1 s, the same Trainer fitted again 100 s later: Lightning
    calls no on_train_end after an error, so the refit's check at fit start counted the 100 s between as training
    (0 steps more), and its start then dropped the first fit's 2 s. It goes on from the 2 s, as after a fit that
    ended (1 step more)."""
    clock, timer = Clock(monkeypatch), StepEndTimer(duration={"seconds": 3}, verbose=False)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[clock, timer, RaiseOnce(2)], max_steps=20,
                        enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="the user's error"):
            trainer.fit(Regression(), train_dataloaders=loader())
        assert timer.time_elapsed() == 2.0
        clock.now += 100.0
        assert timer.time_elapsed() == 2.0
        trainer.fit(trainer.lightning_module, train_dataloaders=loader())
    assert trainer.global_step == 3 and timer.time_elapsed() == 3.0
