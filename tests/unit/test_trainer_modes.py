"""lit_dtrain's callbacks under Lightning's Trainer modes and entry points in a project of one's own: a second
``trainer.fit`` of the same Trainer on another datamodule (staged training), ``trainer.validate()``, ``test()`` and
``predict()`` with ``ckpt_path=`` after a fit. ``fast_dev_run`` is tested beside each
callback (``test_model_checkpoint.py``, ``test_wsd_trainer_horizon.py``) and under train.py
(``test_train_py_fast_dev_run.py``), ``trainer.test()``/``predict()`` in ``test_throughput.py``."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lit_dtrain.callbacks import (
    AdaptiveGradClip,
    LossSpikeMonitor,
    ModelCheckpoint,
    SelectiveCheckpointing,
    WSDScheduler,
    token_throughput_monitor,
)
from tests.unit._user_project_helpers import UserLM, _equal, lm_data


class Indexed(Dataset):
    """32 regression samples as dict batches with their ``index``; ``seed`` picks other data."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(32, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True), "index": i, "input_ids": torch.zeros(3).long()}


class Data(L.LightningDataModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(self.seed), batch_size=4)

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


class Spiking(L.LightningModule):
    """A linear regression whose loss is 30x on a batch that holds a sample of ``spike`` (the first data's 13)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.spike, self.indices = torch.nn.Linear(4, 1), {13}, []

    def training_step(self, batch, batch_idx):
        self.indices.append(batch["index"].tolist())
        loss = F.mse_loss(self.net(batch["x"]), batch["y"])
        return loss * 30 if self.spike & set(batch["index"].tolist()) else loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.net(batch["x"]), batch["y"]))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.net(batch["x"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _staged(tmp_path, second_data, clear: bool = False) -> tuple[LossSpikeMonitor, list[str]]:
    """Fit 8 steps on Data(0) (the batch of samples 12..15 spikes at step 3 and is excluded), then 8 more of the same
    Trainer on ``second_data`` without a spike; the monitor and the warnings of the second fit."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=str(tmp_path))
    module, first = Spiking(), Data(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=first)
    assert monitor.excluded == [12, 13, 14, 15]
    module.spike = set()
    if clear:
        monitor.excluded.clear()
    trainer.fit_loop.epoch_loop.max_steps = 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=first if second_data is None else second_data)
    return monitor, [str(w.message) for w in caught if "LossSpikeMonitor: this fit" in str(w.message)]


def test_exclusions_cleared_between_two_fits_are_not_skipped(tmp_path):
    """monitor.excluded.clear() between two fits of the same Trainer (staged training on other data): the second fit
    still skipped its step 11, whose batch held indices 12..15 (the device copy of the exclusions was kept)."""
    monitor, _ = _staged(tmp_path, Data(7), clear=True)
    assert monitor.excluded == [] and [e["step"] for e in monitor.events] == [3]


def test_a_second_fit_on_another_datamodule_is_told_its_exclusions_name_other_samples(tmp_path):
    """Staged training: the same Trainer fitted on a second datamodule skipped its step 11, whose batch held indices
    12..15, because samples 12..15 of the first data had spiked (an 'excluded_sample' event, no word). It still
    skips them (the indices may be the same data's), and says so, naming the indices and how to start afresh."""
    monitor, said = _staged(tmp_path / "other", Data(7))
    assert [e["step"] for e in monitor.events if e["reasons"] == ["excluded_sample"]] == [11]
    assert len(said) == 1 and "another Data than the previous fit" in said[0] and "[12, 13, 14, 15]" in said[0]
    assert "monitor.excluded.clear()" in said[0]
    monitor, said = _staged(tmp_path / "cleared", Data(7), clear=True)  # the way out it names: nothing to say
    assert said == []
    monitor, said = _staged(tmp_path / "same", None)  # the same datamodule again: its own samples, no warning
    assert said == [] and [e["step"] for e in monitor.events if e["reasons"] == ["excluded_sample"]] == [11]


def test_a_monitor_that_served_a_fit_pickles_for_a_spawned_trainer(tmp_path):
    """``Trainer(strategy="ddp_spawn")`` pickles its callbacks to start the ranks: a LossSpikeMonitor that had served
    a fit in this process (a notebook's first run) failed there, ``TypeError: cannot pickle 'weakref.ReferenceType'
    object`` (its weak note of the fit's Trainer and data). The copy holds the fit's state; a deepcopy in this process
    still knows the Trainer, for the warning of a second fit on other data."""
    import pickle

    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Spiking(), datamodule=Data(0))
    spawned = pickle.loads(pickle.dumps(monitor))
    assert spawned.excluded == monitor.excluded == [12, 13, 14, 15] and spawned.num_spikes == monitor.num_spikes == 1
    assert [e["step"] for e in spawned.events] == [3] and spawned._fit_data[0]() is None
    assert copy.deepcopy(monitor)._fit_data[0]() is trainer


def test_evaluating_a_checkpoint_after_a_fit_leaves_the_callbacks_fit_state(tmp_path):
    """Lightning loads every callback's state from ``ckpt_path`` in trainer.validate(), test() and predict() too: after
    a fit to step 8, validate(ckpt_path=<step 2>) set the LossSpikeMonitor's spikes to 0 and its exclusions to none,
    AdaptiveGradClip's statistics (7 steps) and WSDScheduler's step to step 2's, the ModelCheckpoint's top-k to step
    2's, and a later fit of the same Trainer went on from them (the excluded batch spiked again; train/samples fell
    from 32 to 12). The fit's states stay now."""
    callbacks = [LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2), AdaptiveGradClip(),
                 WSDScheduler(warmup_steps=1, decay_fraction=0.25), token_throughput_monitor(window_size=2),
                 SelectiveCheckpointing(policy="full", module_pattern="net"),
                 ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1, every_n_train_steps=2)]
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, default_root_dir=str(tmp_path),
                        limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1, num_sanity_val_steps=0)
    module, data = Spiking(), Data(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
        fitted = [copy.deepcopy(c.state_dict()) for c in callbacks]
        assert fitted[0]["num_spikes"] == 1 and fitted[1]["optimizers"][0]["stat"]["count"] == 7
        assert fitted[2]["last_step"] == 8 and fitted[3]["samples"] == 32
        step2 = str(tmp_path / "ck" / "step=2.ckpt")
        trainer.validate(module, datamodule=data, ckpt_path=step2, verbose=False)
        trainer.test(module, datamodule=data, ckpt_path=step2, verbose=False)
        trainer.predict(module, datamodule=data, ckpt_path=step2)
    for callback, state in zip(callbacks, fitted):
        assert _equal(callback.state_dict(), state), type(callback).__name__
    trainer.fit_loop.epoch_loop.max_steps = 10  # a later fit goes on from the fit's totals: 32 + 2 batches of 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    assert callbacks[3].state_dict()["samples"] == 40  # was 16: step 2's 8, then 2 batches


def test_a_fast_dev_run_leaves_the_spike_records_of_its_default_root_dir(tmp_path):
    """A Trainer(fast_dev_run=4) smoke test in the default_root_dir of a finished run moved that run's spikes.jsonl
    records (the spike at step 3) to spikes.superseded.jsonl, as a fit from step 0 replaying them would, and wrote its
    own there (its own spike at step 3), though Lightning suppresses logging and checkpointing in it."""
    def trainer(actions, **kwargs) -> L.Trainer:
        return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=0,
                         callbacks=[LossSpikeMonitor(actions=actions, warmup_steps=2)], **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(["log", "skip"], max_steps=8).fit(Spiking(), datamodule=Data(0))
        records = (tmp_path / "spikes.jsonl").read_text()
        assert '"step": 3' in records
        smoke = trainer(["log", "skip"], fast_dev_run=4)  # its step 3 spikes too: logged, not written
        smoke.fit(Spiking(), datamodule=Data(0))
    (monitor,) = [c for c in smoke.callbacks if isinstance(c, LossSpikeMonitor)]
    assert [e["step"] for e in monitor.events] == [3]
    assert (tmp_path / "spikes.jsonl").read_text() == records and not (tmp_path / "spikes.superseded.jsonl").exists()


def test_a_stop_signal_in_a_fast_dev_run_saves_no_checkpoint(tmp_path):
    """PreemptionCheckpoint saved <dirpath>/last.ckpt at a SIGTERM (or Ctrl-C) in a Trainer(fast_dev_run=4) smoke test
    though Lightning suppresses checkpointing there: with the dirpath of a real run, the smoke test's step-2 state
    replaced that run's last.ckpt. The fit stops at the step's end as before, and the file is left as it is."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lit_dtrain.callbacks import PreemptionCheckpoint
    from tests.unit.test_user_project_edges import SigtermAtBatch

    (tmp_path / "ck").mkdir()
    last = tmp_path / "ck" / "last.ckpt"
    last.write_bytes(b"the real run's")
    trainer = L.Trainer(accelerator="cpu", fast_dev_run=4, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SigtermAtBatch(1), PreemptionCheckpoint(dirpath=str(tmp_path / "ck"))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SIGTERMException):
            trainer.fit(Spiking(), datamodule=Data(0))
    assert trainer.global_step == 2 and last.read_bytes() == b"the real run's"


class ValidatedLM(UserLM):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)["loss"]


def test_an_evaluation_with_ckpt_path_leaves_the_datamodules_state(tmp_path):
    """``trainer.validate(ckpt_path=<step 2>)`` after a fit to step 8 set ``LMDataModule``'s step back to step 2's and
    its FourierSampler table to 2 updates (Lightning restores a datamodule's state in an evaluation too), and a later
    fit of the same Trainer drew from there. The datamodule keeps its fit's state now; a fit with ckpt_path= still
    restores it."""
    from lit_dtrain.callbacks import FourierSamplerCallback

    data, module = lm_data(tmp_path), ValidatedLM(per_token=True)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=1,
                        num_sanity_val_steps=0, val_check_interval=2, check_val_every_n_epoch=None,
                        callbacks=[FourierSamplerCallback(),
                                   ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
        fitted = copy.deepcopy(data.state_dict())
        assert fitted["micro_step"] == 8 and fitted["sampler"]["updates"] == 8
        trainer.validate(module, datamodule=data, ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"), verbose=False)
    assert _equal(data.state_dict(), fitted)
    fresh = lm_data(tmp_path)  # a fit from the same file restores it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False, limit_val_batches=0, callbacks=[FourierSamplerCallback()]).fit(
            ValidatedLM(per_token=True), datamodule=fresh, ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert fresh.state_dict()["micro_step"] == 3 and fresh.state_dict()["sampler"]["updates"] == 3


class SeenIndices(L.Callback):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(batch["index"].tolist())


def test_overfit_batches_cycles_lmdatamodules_first_batches(tmp_path):
    """``Trainer(overfit_batches=2)`` limits a DataLoader to its first 2 batches; ``LMDataModule`` draws by step, so
    every step trained on new windows (6 steps, 6 different batches) and the overfit never happened. It cycles its
    first 2 batches now, through a resume too; a fraction, which means nothing for a stream drawn step by step without
    an end, is refused by Lightning."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lit_dtrain.callbacks import FourierSamplerCallback

    def fit(data, max_steps, ckpt_path=None, overfit=2):
        seen = SeenIndices()
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1, every_n_train_steps=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, overfit_batches=overfit, default_root_dir=str(tmp_path),
                      callbacks=[seen, FourierSamplerCallback(), checkpoints]).fit(
                ValidatedLM(per_token=True), datamodule=data, ckpt_path=ckpt_path)
        return seen.seen

    seen = fit(lm_data(tmp_path), 6)
    assert seen[0] != seen[1] and seen == [seen[0], seen[1]] * 3
    assert fit(lm_data(tmp_path), 6, ckpt_path=str(tmp_path / "ck" / "step=3.ckpt")) == [seen[1], seen[0], seen[1]]
    with pytest.raises(MisconfigurationException, match=r"must be `1.0` or an int"):
        fit(lm_data(tmp_path), 2, overfit=0.5)
    # Lightning's "100% of the batches" cycled one batch (4 steps on [581, 405, 239, 548]), as overfit_batches=1 does
    with pytest.raises(ValueError, match=r"^LMDataModule: Trainer\(overfit_batches=1.0\) means all batches .* "
                                         r"as an int \(overfit_batches=1\), or leave it out$"):
        fit(lm_data(tmp_path), 2, overfit=1.0)


def test_scale_batch_size_restores_its_step_0_file_without_a_batch_warning(tmp_path, caplog):
    """``Tuner.scale_batch_size`` restores the step-0 checkpoint it saved with the batch size it found: LMDataModule
    warned 'the checkpoint trained on global batches of 4 windows ..., and this run's are 8 ... (data.batch_size=4
    keeps its batch)', advice to undo the tuning, of a file that drew no batch. A checkpoint that drew one still
    warns (tests/unit/test_data_resume_and_exclusions.py)."""
    from lightning.pytorch.tuner import Tuner

    from lit_dtrain.data.samplers import RandomSampler

    data = lm_data(tmp_path)
    data.sampler = RandomSampler()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                        limit_val_batches=0)
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="lit_dtrain"):
        warnings.simplefilter("ignore")
        found = Tuner(trainer).scale_batch_size(UserLM(per_token=True), datamodule=data, max_trials=3,
                                                steps_per_trial=1)
    assert found == data.batch_size == 8 and data.micro_step == 0
    assert not [r.getMessage() for r in caplog.records if "global batches" in r.getMessage()]


def test_lr_find_on_a_fourier_sampler_is_told_that_the_tuner_runs_without_callbacks(tmp_path):
    """``Tuner.lr_find`` trains without the Trainer's callbacks, so a FourierSampler with its callback in the Trainer
    stopped at step 2 with 'never received a training update: add the callback', which was there. The error says
    why now; with ``require_updates=False`` the search runs and the Tuner gives the datamodule its step 0 back."""
    from lightning.pytorch.tuner import Tuner

    from lit_dtrain.callbacks import FourierSamplerCallback

    class Tunable(UserLM):
        def __init__(self) -> None:
            super().__init__(per_token=True)
            self.lr = 1e-3

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def lr_find(data):
        trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                            limit_val_batches=0, callbacks=[FourierSamplerCallback()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Tuner(trainer).lr_find(Tunable(), datamodule=data, num_training=4, early_stop_threshold=None)

    with pytest.raises(RuntimeError, match=r"never received a training update.*Tuner\.lr_find .*without the Trainer's"):
        lr_find(lm_data(tmp_path))
    data = lm_data(tmp_path)
    data.sampler.require_updates = False
    assert lr_find(data) is not None and data.micro_step == 0


def test_overfit_batches_resumed_on_another_batch_size_keeps_its_windows_at_the_new_size(tmp_path):
    """LMDataModule kept the overfit batches' indices at the checkpoint's global batch: a resume with data.batch_size
    8 of a batch-4 checkpoint trained on 4 windows a step (under DDP on more ranks, rank 1's shard would be empty),
    while the global-batch warning said 8. The kept windows are now topped up to the new size (or cut to it)."""
    def fit(data, max_steps, ckpt_path=None):
        seen = SeenIndices()
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1, every_n_train_steps=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, overfit_batches=1, default_root_dir=str(tmp_path),
                      callbacks=[seen, checkpoints]).fit(ValidatedLM(per_token=True), datamodule=data,
                                                         ckpt_path=ckpt_path)
        return seen.seen

    def data(batch_size):
        from lit_dtrain.data.samplers import RandomSampler

        d = lm_data(tmp_path)
        d.sampler, d.batch_size = RandomSampler(), batch_size
        return d

    [first, again] = fit(data(4), 2)
    assert len(first) == 4 and again == first
    bigger = fit(data(8), 4, str(tmp_path / "ck" / "step=2.ckpt"))
    assert len(bigger) == 2 and bigger[0] == bigger[1] and len(bigger[0]) == 8 and bigger[0][:4] == first
    assert fit(data(2), 4, str(tmp_path / "ck" / "step=2.ckpt")) == [first[:2], first[:2]]


def test_overfit_batches_leaves_out_windows_the_spike_monitor_excluded(tmp_path):
    """LossSpikeMonitor's ``skip`` excludes a spiking batch's windows through the sampler, whose draws the kept
    overfit windows bypass: under ``Trainer(overfit_batches=1)`` they trained again at every later step. The slot
    keeps its other windows and takes the sampler's draw (without the excluded) for the rest."""
    from types import SimpleNamespace

    data = lm_data(tmp_path)
    data.prepare_data()
    data.setup("fit")
    data.trainer = SimpleNamespace(overfit_batches=1, global_rank=0, world_size=1, accumulate_grad_batches=1)
    first = data.next_train_batch()["index"].tolist()
    assert data.next_train_batch()["index"].tolist() == first
    data.sampler.exclude(first[:2])  # as the monitor does on a spike
    then = data.next_train_batch()["index"].tolist()
    assert len(then) == len(first) and then[:2] == first[2:] and not set(then) & set(first[:2])
    assert data.next_train_batch()["index"].tolist() == then
