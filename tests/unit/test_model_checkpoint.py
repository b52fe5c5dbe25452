"""lit_dtrain's ModelCheckpoint: last.ckpt holds the newest validation's state, not the best one's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def test_last_ckpt_is_written_at_every_validation_not_only_at_a_new_best(tiny_cfg):
    """lightning 2.6 writes last.ckpt only where the top-k checkpoint changed: with a val/loss that stopped
    improving (mode=max here: every later validation is 'worse'), a run that failed at step 5 left last.ckpt at
    step 2, the first validation, and resume=auto trained steps 2-4 again."""
    from lit_dtrain.train import train

    common = ("trainer.max_steps=6", "trainer.val_check_interval=2", "callbacks.model_checkpoint.mode=max",
              "sample.max_new_tokens=0")
    fault = ("+callbacks.fault._target_=tests.faults.RaiseOnceAt", "+callbacks.fault.hook=on_after_backward",
             "+callbacks.fault.step=5")
    cfg = tiny_cfg(*common, *fault)
    with pytest.raises(RuntimeError, match="interrupted at step 5"):
        train(cfg)
    ckpts = Path(cfg.paths.checkpoint_dir)
    best = [p for p in ckpts.iterdir() if p.name.startswith("step")]
    assert len(best) == 1 and _step(best[0]) == 2  # the top-k checkpoint did not change after step 2
    assert _step(ckpts / "last.ckpt") == 4  # the newest validation's
    metrics, _ = train(tiny_cfg(*common, "resume=auto"))
    assert metrics["steps"] == 6 and _step(ckpts / "last.ckpt") == 6


def test_it_is_lightnings_model_checkpoint_in_a_project_of_ones_own():
    from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

    from lit_dtrain.callbacks import ModelCheckpoint

    assert issubclass(ModelCheckpoint, LightningModelCheckpoint)
    assert ModelCheckpoint(save_last=True).state_key == LightningModelCheckpoint(save_last=True).state_key


def test_a_checkpoint_of_non_finite_weights_does_not_replace_last_ckpt(tiny_cfg, caplog):
    """module.check_finite=false and a LossSpikeMonitor with check_grad=false: a NaN gradient under a finite loss at
    step 3 (of 0..5) was applied, the validation at step 4 wrote last.ckpt with the NaN weights, and the monitor
    stopped the run at step 4's NaN loss, telling the user to resume from a checkpoint written before the update;
    resume=auto resumed the NaN last.ckpt (and stopped again). Now that save is skipped with a warning, last.ckpt
    keeps step 2, and resume=auto trains on from there to finite weights."""
    from lit_dtrain.module import NonFiniteError
    from lit_dtrain.train import train

    common = ("trainer.max_steps=6", "trainer.val_check_interval=2", "sample.max_new_tokens=0",
              "module.check_finite=false", "callbacks=[default,loss_spike]", "callbacks.loss_spike.check_grad=false",
              "callbacks.loss_spike.warmup_steps=2")
    cfg = tiny_cfg(*common, "+callbacks.fault._target_=tests.faults.PoisonGradAtStep", "+callbacks.fault.step=3")
    with caplog.at_level("WARNING", logger="lit_dtrain.checkpoint"), pytest.raises(NonFiniteError):
        train(cfg)
    last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    (line,) = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert line.startswith(f"checkpoint '{last}' not written: the weights at step 4 are not finite (NaN/inf in ")
    assert line.endswith("the previous file at that path is intact (step 2)"), line
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 2
    assert all(t.isfinite().all() for t in saved["state_dict"].values())
    metrics, objects = train(tiny_cfg(*common, "resume=auto"))
    assert metrics["steps"] == 6 and all(p.isfinite().all() for p in objects["model"].parameters())


def test_the_non_finite_check_reads_parameters_only(tmp_path):
    """A buffer may hold -inf (an attention mask): only the parameters named to AtomicCheckpointIO are checked."""
    from lit_dtrain.checkpoint import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    state = {"w": torch.ones(2), "mask": torch.tensor([0.0, float("-inf")]), "steps": torch.tensor([3])}
    AtomicCheckpointIO(["w"]).save_checkpoint({"global_step": 1, "state_dict": state}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    state["w"] = torch.tensor([1.0, float("inf")])
    AtomicCheckpointIO(["w"]).save_checkpoint({"global_step": 2, "state_dict": state}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1


def test_a_moved_run_dir_resumes_its_checkpoint_files(tiny_cfg, tmp_path):
    """mv <run a> <run b>, then run_name=b resume=auto: Lightning restores ModelCheckpoint's state only where the
    saved dirpath is this one, so the resumed run wrote last-v1.ckpt beside last.ckpt and kept the old best step file
    beside the new one (save_top_k=1). Now the saved paths are read in the new dir."""
    from lit_dtrain.train import train

    common = ("trainer.val_check_interval=2", "sample.max_new_tokens=0")
    train(tiny_cfg(*common, "trainer.max_steps=2", run="a"))  # (val/loss 5.29 at step 2, 5.13 at step 4: a new best)
    (tmp_path / "a").rename(tmp_path / "b")
    train(tiny_cfg(*common, "trainer.max_steps=4", "resume=auto", run="b"))
    files = sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("*.ckpt"))
    assert len(files) == 2 and files[0] == "last.ckpt" and files[1].startswith("step000004"), files
    assert _step(tmp_path / "b" / "checkpoints" / "last.ckpt") == 4


def test_a_timed_save_under_gradient_accumulation_waits_for_the_end_of_the_optimizer_step(tmp_path, monkeypatch):
    """train_time_interval saves at a train batch's end: Lightning's saved at the first micro-batch past the interval,
    mid-step (micro-batch 17 of 4 per step, at step 4), without the gradient accumulated so far; a resume from it ran
    step 5 on 3 micro-batches and ended off a straight run (val 4.7875 against 4.7873 in a tiny train.py run). Each
    timed save is at a step's end now: its micro-batch count is 4 x its global_step. (A clock that ticks once per
    reading: the interval ends at micro-batches that do not end a step.)"""
    import itertools
    import types
    from datetime import timedelta

    import lightning as L
    import lightning.pytorch.callbacks.model_checkpoint as lightning_checkpoint

    from lit_dtrain.callbacks import ModelCheckpoint
    from tests.toys import TinyRegression

    ticks = itertools.count()
    monkeypatch.setattr(lightning_checkpoint, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks))))
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", train_time_interval=timedelta(seconds=2.5),
                           save_top_k=-1)
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=4, callbacks=[ckpt], logger=False, accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(TinyRegression())
    saved = {p.name: torch.load(p, weights_only=True) for p in sorted(tmp_path.glob("*.ckpt"))}
    assert saved, "no timed save"
    batches = {n: c["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] for n, c in saved.items()}
    assert all(batches[n] == 4 * c["global_step"] for n, c in saved.items()), batches


def test_an_every_n_train_steps_save_at_a_validation_step_holds_that_validations_loss(tmp_path):
    """every_n_train_steps=2 with a validation every 2 steps: Lightning saved at the train batch's end, before the
    validation (but at an epoch's last batch), so step 6's file was named and ranked by step 4's val_loss, and a resume
    from it skipped the step-6 validation (a kill during it: never run). Each file is written at its validation's end
    now, with its loss."""
    import lightning as L

    from lit_dtrain.callbacks import ModelCheckpoint
    from tests.unit.test_user_project_combinations import Regression, data

    logged = {}

    class ValLosses(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            logged[trainer.global_step] = round(float(trainer.callback_metrics["val_loss"]), 4)

    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}-{val_loss:.4f}", monitor="val_loss", save_top_k=-1,
                           every_n_train_steps=2, auto_insert_metric_name=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, limit_train_batches=4, val_check_interval=0.5,
                        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ckpt, ValLosses()])
    trainer.fit(Regression(), data(), data())
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [f"{s}-{logged[s]:.4f}.ckpt" for s in (2, 4, 6, 8)]


def test_a_resume_with_a_lower_save_top_k_keeps_that_many_files(tmp_path):
    """Lightning prunes the top-k only where it holds exactly save_top_k files: a run resumed with save_top_k=1 from
    one with -1 kept all its step files and every later one (5 step files after 15 steps of a tiny train.py run)."""
    import lightning as L

    from lit_dtrain.callbacks import ModelCheckpoint
    from tests.unit.test_user_project_combinations import Regression, data

    def fit(top_k: int, max_steps: int, ckpt_path=None) -> ModelCheckpoint:
        ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", monitor="val_loss", save_top_k=top_k,
                               save_last=True)
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, limit_train_batches=4, val_check_interval=0.5,
                            num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[ckpt])
        trainer.fit(Regression(), data(), data(), ckpt_path=ckpt_path)
        return ckpt

    fit(-1, 6)
    assert sorted(p.name for p in tmp_path.glob("step=*.ckpt")) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    ckpt = fit(1, 10, ckpt_path=tmp_path / "last.ckpt")
    assert [p.name for p in tmp_path.glob("step=*.ckpt")] == [Path(ckpt.best_model_path).name]
    assert list(ckpt.best_k_models) == [ckpt.best_model_path]


def test_fast_dev_run_writes_no_last_ckpt(tmp_path):
    """Lightning 2.6's ModelCheckpoint(save_last=True) wrote last.ckpt at the end of a Trainer(fast_dev_run=True) fit
    ("checkpointing is suppressed"), and a real run with ckpt_path="last" in the same dirpath then resumed the smoke
    test's step-1 weights (it trained 3 of its max_steps=4). Nothing is written now, and that run starts from step 0."""
    import warnings

    import lightning as L

    from lit_dtrain.callbacks import ModelCheckpoint
    from tests.unit.test_user_project_combinations import Regression, data

    def trainer(**kwargs) -> L.Trainer:
        return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], **kwargs)

    trainer(fast_dev_run=True).fit(Regression(), data(), data())
    assert list(tmp_path.iterdir()) == []
    module, real = Regression(), trainer(max_steps=4, limit_train_batches=4, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "No checkpoint file exists")  # (Lightning: a fit from scratch)
        real.fit(module, data(), data(), ckpt_path="last")
    assert _step(tmp_path / "last.ckpt") == 4 and real.fit_loop.epoch_loop.batch_progress.total.ready == 4


def test_a_validation_in_the_middle_of_an_accumulation_saves_at_that_steps_end(tmp_path):
    """A project's val_check_interval=4 (micro-batches) under accumulate_grad_batches=3 validates after micro-batch 4,
    1 of step 2's 3: the save there held a step half accumulated (its grads are in no file), and a resume from it ran
    step 2 on its last 2 micro-batches: every mid-step file (steps 1, 2, 5) resumed 0.008-0.052 off the straight run,
    last.ckpt too. The save waits for the end of the step now, with that validation's val_loss, and each file
    resumes bitwise; a fit stopped at that validation still saves its state there."""
    import lightning as L
    import torch.nn.functional as F

    from lit_dtrain.callbacks import ModelCheckpoint
    from tests.unit._user_project_helpers import UserLM, _equal
    from tests.unit.test_own_project_epoch_stops import _data

    class Validated(UserLM):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.head(self.embed(batch["input_ids"])).flatten(0, 1),
                                                 batch["labels"].flatten()))

    class StopAtValidation(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            trainer.should_stop = True

    def fit(run: str, ckpt_path=None, callbacks=()) -> L.Trainer:
        ckpt = ModelCheckpoint(dirpath=tmp_path / run, filename="{step}", monitor="val_loss", save_top_k=-1,
                               save_last=True)
        trainer = L.Trainer(accelerator="cpu", max_steps=6, accumulate_grad_batches=3, val_check_interval=4,
                            limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[ckpt, *callbacks])
        trainer.fit(Validated(), datamodule=_data(tmp_path), ckpt_path=ckpt_path)
        return trainer

    straight = fit("straight")
    files = {p.name: _step(p) for p in (tmp_path / "straight").glob("*.ckpt")}
    # validations after micro-batches 4, 8, 12 and 16: saved at steps 2, 3, 4 (a step's end already) and 6
    assert files == {"step=2.ckpt": 2, "step=3.ckpt": 3, "step=4.ckpt": 4, "step=6.ckpt": 6, "last.ckpt": 6}
    for name in ("step=2.ckpt", "step=3.ckpt"):
        resumed = fit(f"from-{name}", ckpt_path=tmp_path / "straight" / name)
        assert _equal(resumed.lightning_module.state_dict(), straight.lightning_module.state_dict())
        assert _equal(resumed.optimizers[0].state_dict(), straight.optimizers[0].state_dict())
    stopped = fit("stopped", callbacks=[StopAtValidation()])
    assert stopped.global_step == 1 and _step(tmp_path / "stopped" / "step=1.ckpt") == 1

    class RaisesAtMicroBatch5(Validated):  # after the validation at micro-batch 4, before step 2's end
        def training_step(self, batch, batch_idx):
            if self.trainer.fit_loop.epoch_loop.batch_progress.total.ready == 5 and not hasattr(self, "raised"):
                self.raised = True
                raise RuntimeError("a failure of one's own")
            return super().training_step(batch, batch_idx)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "again", filename="{step}", monitor="val_loss", save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, accumulate_grad_batches=3, val_check_interval=4,
                        limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt])
    module = RaisesAtMicroBatch5()
    with pytest.raises(RuntimeError, match="of one's own"):
        trainer.fit(module, datamodule=_data(tmp_path))
    # the same Trainer fitted again owes the failed fit no save (it saved at its first step's end, where no val_loss
    # was logged yet: MisconfigurationException, could not find the monitored key)
    trainer.fit(module, datamodule=_data(tmp_path))
    assert trainer.global_step == 6


def test_a_mid_step_validations_save_gives_way_to_the_validation_at_that_steps_end(tmp_path):
    """val_check_interval=2 (micro-batches) under accumulate_grad_batches=3 validates after micro-batches 4 (mid-step
    2) and 6 (step 2's end). The save of the mid-step one, made at step 2's end, took that step's file before step 2's
    own validation ran: step=2 was named and ranked by the validation of step 1's weights (5.66788 where step 2's gave
    5.54834; the last, step=4, 5.43072 for 5.32374, the best never ranked), and the step's own validation was then
    skipped as saved; a resume from that file, saved before it, never ran it. That validation saves now."""
    import lightning as L
    import torch.nn.functional as F

    from lit_dtrain.callbacks import ModelCheckpoint
    from tests.unit._user_project_helpers import UserLM
    from tests.unit.test_own_project_epoch_stops import _data

    at_step_end = {}  # global_step -> val_loss of the validation run at that step's end

    class Validated(UserLM):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.head(self.embed(batch["input_ids"])).flatten(0, 1),
                                                 batch["labels"].flatten()))

        def on_validation_end(self):
            if self.trainer.fit_loop.epoch_loop.batch_progress.total.ready % 3 == 0:
                at_step_end[self.trainer.global_step] = float(self.trainer.callback_metrics["val_loss"])

    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", monitor="val_loss", save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, accumulate_grad_batches=3, val_check_interval=2,
                        limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt])
    trainer.fit(Validated(), datamodule=_data(tmp_path))
    scores = {_step(Path(path)): float(score) for path, score in ckpt.best_k_models.items()}
    assert sorted(at_step_end) == [2, 4] and scores[2] == at_step_end[2] and scores[4] == at_step_end[4]
    assert ckpt.best_model_score == at_step_end[4] and _step(Path(ckpt.best_model_path)) == 4
    saved = torch.load(tmp_path / "step=2.ckpt", map_location="cpu", weights_only=False)
    assert saved["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]["total"]["completed"] == 3 * 2


def test_an_every_n_train_steps_save_at_an_epochs_last_batch_without_a_validation_is_made_there(tmp_path):
    """Lightning defers a step-triggered save at an epoch's last batch to the validation it takes to follow it; with a
    val_check_interval (4 batches) that does not divide the epoch (9) none runs there: every_n_train_steps=3 over 2
    epochs wrote no step=9 (its save was made at step 13's validation, as step=13) and no step=18, and last.ckpt ended
    at step 15 of 18. Such a save is made at that batch now (a monitor no validation has logged yet still waits for
    one: step 3's file is step 4's, as Lightning's)."""
    import lightning as L
    import torch.nn.functional as F

    from lit_dtrain.callbacks import ModelCheckpoint
    from tests.unit._user_project_helpers import UserLM
    from tests.unit.test_own_project_epoch_stops import _data

    class Validated(UserLM):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.head(self.embed(batch["input_ids"])).flatten(0, 1),
                                                 batch["labels"].flatten()))

    ckpt = ModelCheckpoint(dirpath=tmp_path / "c", filename="{step}", monitor="val_loss", save_top_k=-1,
                           save_last=True, every_n_train_steps=3)
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=9, val_check_interval=4,
                        limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt])
    trainer.fit(Validated(), datamodule=_data(tmp_path))
    files = {p.name: _step(p) for p in (tmp_path / "c").glob("*.ckpt")}
    assert trainer.global_step == 18 and files == {
        "step=4.ckpt": 4, "step=6.ckpt": 6, "step=9.ckpt": 9, "step=12.ckpt": 12, "step=15.ckpt": 15,
        "step=18.ckpt": 18, "last.ckpt": 18}
