"""token_throughput_monitor in a LightningModule of one's own: tokens and sequences counted from ``input_ids``, and a
batch of another shape rejected with an error that says what the monitor needs."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import token_throughput_monitor
from tests.conftest import event_files


class Tokens(L.LightningModule):
    def __init__(self, tuples: bool = False) -> None:
        super().__init__()
        self.emb, self.tuples = torch.nn.Embedding(16, 4), tuples
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        ids = batch[0] if self.tuples else batch["input_ids"]
        return self.emb(ids).square().mean()

    def train_dataloader(self):
        ids = torch.randint(0, 16, (24, 6), generator=torch.Generator().manual_seed(0))
        items = [(r,) for r in ids] if self.tuples else [{"input_ids": r} for r in ids]
        return DataLoader(items, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module: L.LightningModule, tmp_path: Path, accumulate: int = 1) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, callbacks=[token_throughput_monitor(window_size=2)],
                        accumulate_grad_batches=accumulate,
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


def test_counts_sequences_and_tokens_of_input_ids(tmp_path: Path) -> None:
    import csv

    fit(Tokens(), tmp_path)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")) if r.get("train/samples")]
    assert [float(r["train/samples"]) for r in rows] == [4.0, 8.0, 12.0, 16.0]  # batches of 4 sequences
    assert [float(r["train/lengths"]) for r in rows] == [24.0, 48.0, 72.0, 96.0]  # of 6 tokens each
    last = rows[-1]
    assert float(last["train/device/items_per_sec"]) == pytest.approx(6 * float(last["train/device/samples_per_sec"]))


def test_a_batch_without_input_ids_is_an_error_that_names_the_contract(tmp_path: Path) -> None:
    """Refused at the first batch's start, before it trains (it was refused at its end, after an optimizer step)."""
    module = Tokens(tuples=True)
    with pytest.raises(TypeError, match=r"input_ids.*got list.*ThroughputMonitor\(batch_size_fn"):
        fit(module, tmp_path)
    assert module.steps_run == 0


def test_window_size_counts_optimizer_steps_under_gradient_accumulation(tmp_path: Path) -> None:
    """``window_size`` is in optimizer steps (conf/callbacks/default.yaml: "steps averaged for tokens/s"). Lightning's
    window counts the batches it is updated with, which are micro-batches: with accumulate_grad_batches=3 a window of
    2 covered two thirds of one step, and the rate was first logged after the first step instead of the second."""
    import csv

    fit(Tokens(), tmp_path, accumulate=3)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")) if r.get("train/samples")]
    assert [int(float(r["train/batches"])) for r in rows] == [3, 6, 9, 12]  # micro-batches, logged once per step
    with_rate = [int(float(r["train/batches"])) for r in rows if r.get("train/device/items_per_sec")]
    assert with_rate == [6, 9, 12]  # from the end of the 2nd step: a window of 2 steps = 6 micro-batches


def test_peak_flops_of_gpus_lightnings_table_misses():
    """torch names an H200 "NVIDIA H200" (or "... NVL"); Lightning's table matches "sxm1"/"nvl1" only, so on the H200
    that ran the GPU checks no MFU was logged ("FLOPs not found for 'NVIDIA H200'")."""
    from lit_dtrain.callbacks.throughput import peak_flops_lightning_lacks as peak

    assert peak("NVIDIA H200", "bf16-mixed") == peak("NVIDIA H200", "16-mixed") == 989.4e12  # the H100 SXM's
    assert peak("NVIDIA H200", "32-true", "high") == 494.7e12  # TF32 tensor cores
    assert peak("NVIDIA H200", "32-true", "highest") == 66.9e12
    assert peak("NVIDIA H200 NVL", "bf16-true") == peak("NVIDIA H100 NVL", "bf16-mixed") == 835.5e12
    assert peak("NVIDIA H100 80GB HBM3", "bf16-mixed") is None  # Lightning knows it
    assert peak("NVIDIA H200", "transformer-engine") is None


def test_on_an_h100_nvl_mfu_uses_one_cards_dense_peak_not_lightnings(monkeypatch) -> None:
    """Lightning's table gives "NVIDIA H100 NVL" a bridged pair's figures (bf16 1978.8e12, NVIDIA's preliminary sheet
    for two cards), and its value was kept whenever it had one: MFU on one H100 NVL read 0.42 of what it was. The
    monitor's setup is run on a stand-in trainer whose root device is a CUDA device of that name."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.trainer.states import RunningStage

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    trainer = SimpleNamespace(
        precision_plugin=MixedPrecision("bf16-mixed", "cuda"), precision="bf16-mixed", world_size=1,
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), enable_validation=False, global_step=0,
        state=SimpleNamespace(stage=RunningStage.TRAINING), accumulate_grad_batches=1)
    from lightning.fabric.utilities.throughput import get_available_flops

    assert get_available_flops(torch.device("cuda", 0), torch.bfloat16) == 1978.8e12  # Lightning's figure
    monitor = token_throughput_monitor(window_size=2)
    monitor.setup(trainer, None, "fit")
    assert monitor.available_flops == 835.5e12
    assert monitor._throughputs[RunningStage.TRAINING].available_flops == 835.5e12
    given = token_throughput_monitor(window_size=2, available_flops=5e14)
    given.setup(trainer, None, "fit")
    assert given.available_flops == 5e14


class FlopsTokens(Tokens):
    def training_step(self, batch, batch_idx):
        self.flops_per_batch = 1e6
        return super().training_step(batch, batch_idx)


def test_available_flops_gives_mfu_on_any_device(tmp_path: Path) -> None:
    import csv

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4,
                        callbacks=[token_throughput_monitor(window_size=2, available_flops=1e9)],
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(FlopsTokens())
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv"))
            if r.get("train/device/mfu")]
    assert rows, "no MFU logged"
    for r in rows:
        assert float(r["train/device/mfu"]) == pytest.approx(float(r["train/device/flops_per_sec"]) / 1e9)
    with pytest.raises(ValueError, match="available_flops must be > 0"):
        token_throughput_monitor(available_flops=0)


class Validated(Tokens):
    """Tokens with a validation set of 4 batches of 4 sequences of 6 tokens, and a val/loss."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.emb(batch["input_ids"]).square().mean())

    def val_dataloader(self):
        ids = torch.randint(0, 16, (16, 6), generator=torch.Generator().manual_seed(1))
        return DataLoader([{"input_ids": r} for r in ids], batch_size=4)


def test_one_validation_row_per_validation_at_the_step_of_its_val_loss(tmp_path: Path) -> None:
    """Lightning's ThroughputMonitor wrote validate/* every log_every_n_steps validation batches under its own count
    of them (steps 1..4, 5..8, 9..12 between training steps 1, 3, 5), and trainer.validate() after the fit restarted it
    at 1 with counts added to the previous validation's: in TensorBoard the curves went backwards and overlapped."""
    import csv

    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, val_check_interval=2, log_every_n_steps=1,
                        callbacks=[token_throughput_monitor(window_size=2)],
                        logger=[CSVLogger(str(tmp_path), name="csv", version=0),
                                TensorBoardLogger(str(tmp_path), name="tb", version=0)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Validated()
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    val_steps = [int(r["step"]) for r in rows if r.get("val/loss")]
    assert val_steps == [1, 3, 5, 6]  # after steps 2, 4, 6 (0-based 1, 3, 5); trainer.validate at global_step
    rows = [r for r in rows if r.get("validate/batches")]
    assert [int(r["step"]) for r in rows] == val_steps  # one row each, beside its val/loss
    for r in rows:  # this validation's totals, not a running count
        assert (float(r["validate/batches"]), float(r["validate/samples"]), float(r["validate/lengths"])) == (4, 16, 96)
        # rates over the whole validation
        assert float(r["validate/device/items_per_sec"]) == pytest.approx(96 / float(r["validate/time"]))
        assert float(r["validate/device/batches_per_sec"]) == pytest.approx(4 / float(r["validate/time"]))
    steps = {}
    for f in event_files(tmp_path / "tb"):  # fit's file, then the final validate's
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in ("validate/batches", "validate/device/items_per_sec"):
            steps.setdefault(tag, []).extend(e.step for e in acc.Scalars(tag))
    assert steps == {"validate/batches": val_steps, "validate/device/items_per_sec": val_steps}


class LogsLoss(Validated):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


def test_epoch_is_written_once_per_row_of_lightnings_not_again_with_the_throughput_rows(tmp_path: Path) -> None:
    """Given no step, Lightning's logger connector adds ``epoch`` to every row: the monitor's training and validation
    rows each wrote a second ``epoch`` point beside Lightning's own, 2 at every logged step and 4 at a validation's."""
    from collections import Counter

    from lightning.pytorch.loggers import TensorBoardLogger

    from tests.unit.test_callback_logging import _tensorboard_scalars

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, val_check_interval=2, log_every_n_steps=1,
                        callbacks=[token_throughput_monitor(window_size=2)],
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = LogsLoss()
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    tags = _tensorboard_scalars(tmp_path / "tb")
    assert [s for s, _ in tags["train/tokens"]] == [0, 1, 2, 3]
    assert [s for s, _ in tags["validate/batches"]] == [1, 3, 4]
    # Lightning's rows: train/loss at steps 0..3, val/loss at 1 and 3 (fit) and 4 (trainer.validate)
    assert Counter(s for s, _ in tags["epoch"]) == Counter({0: 1, 1: 2, 2: 1, 3: 2, 4: 1})


def csv_trainer(tmp_path: Path, version: int, steps: int) -> L.Trainer:
    """A Trainer logging every step to ``csv/version_<version>`` with the throughput monitor alone."""
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=1,
                     callbacks=[token_throughput_monitor(window_size=2)],
                     logger=CSVLogger(str(tmp_path), name="csv", version=version),
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_the_running_totals_go_on_from_the_checkpoint_after_a_resume(tmp_path: Path) -> None:
    """train/time, train/batches, train/samples and train/lengths are running totals, but Lightning's monitor counts
    from the fit's start: a resumed run's curves fell back to 0 (a 2-rank run resumed at step 10: train/lengths 1408
    in the straight run, 128 in the resumed one). They go on from the checkpoint's totals now."""
    import csv

    def rows(version: int) -> list[dict]:
        return [r for r in csv.DictReader(open(tmp_path / "csv" / f"version_{version}" / "metrics.csv"))
                if r.get("train/samples")]

    ckpt = tmp_path / "two.ckpt"
    for version, steps in ((0, 2), (1, 4)):
        trainer = csv_trainer(tmp_path, version, steps)
        trainer.fit(Tokens(), ckpt_path=ckpt if version else None)
        if not version:
            trainer.save_checkpoint(ckpt)
    first, resumed = rows(0), rows(1)
    assert [float(r["train/batches"]) for r in resumed] == [3.0, 4.0]  # were 1, 2
    assert [float(r["train/samples"]) for r in resumed] == [12.0, 16.0]
    assert [float(r["train/lengths"]) for r in resumed] == [72.0, 96.0]
    assert float(resumed[0]["train/time"]) > float(first[-1]["train/time"])


def test_train_tokens_counts_all_ranks_and_goes_on_across_a_resume_on_other_ranks(tmp_path: Path) -> None:
    """train/lengths is rank 0's count: a real 2-rank run (batch 4 x 64 tokens a rank) resumed on 1 rank after 4 steps
    went on from rank 0's 1024 of the 2048 tokens trained, so no count gave the tokens trained (train/lengths x 2 read
    6144 at the end of a 2 -> 1 -> 2 run of 5120 tokens). train/tokens counts all ranks, each start's tokens times
    its ranks, from the checkpoint's count; a checkpoint that lacks it (written before it existed) logs none."""
    import csv

    import torch

    def tokens(version: int) -> list[str]:
        rows = csv.DictReader(open(tmp_path / "csv" / f"version_{version}" / "metrics.csv"))
        return [r.get("train/tokens") for r in rows if r.get("train/samples")]

    ckpt = tmp_path / "two.ckpt"
    for version, steps, counted in ((0, 2, None), (1, 4, 2 * 48), (2, 4, "old")):
        path = ckpt
        if counted is not None:  # the first 2 steps' count as 2 ranks wrote it (48 tokens each), or none
            state = torch.load(ckpt, weights_only=False)
            monitor = next(k for k in state["callbacks"] if "Throughput" in k)
            assert state["callbacks"][monitor]["tokens"] == 48  # 1 rank: rank 0's lengths
            if counted == "old":
                del state["callbacks"][monitor]["tokens"]
            else:
                state["callbacks"][monitor]["tokens"] = counted
            torch.save(state, path := tmp_path / f"resume{version}.ckpt")
        trainer = csv_trainer(tmp_path, version, steps)
        trainer.fit(Tokens(), ckpt_path=path if version else None)
        if not version:
            trainer.save_checkpoint(ckpt)
    assert [float(t) for t in tokens(0)] == [24.0, 48.0]
    assert [float(t) for t in tokens(1)] == [120.0, 144.0]  # 96 + 24 a step on this 1 rank
    assert tokens(2) == [None, None] or tokens(2) == ["", ""]  # not known: not logged (no column, or empty)
    assert trainer.checkpoint_callback is None and "tokens" not in next(
        v for k, v in trainer._checkpoint_connector.dump_checkpoint()["callbacks"].items() if "Throughput" in k)


def test_a_resume_that_trains_no_step_keeps_the_checkpoints_train_time(tmp_path: Path) -> None:
    """A resume of a run that EarlyStopping (KeepEarlyStop) or max_time had ended trains no step but rewrites
    last.ckpt: its train/time total was written as 0.0 (a real 2-rank run's 3.62 s), so the run branched from that
    last.ckpt logged train/time 0.20 at step 8 where the one from the same step's checkpoint logged 3.80."""
    import torch

    class StopAtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.should_stop = True  # (what KeepEarlyStop does)

    def monitor_state(path: Path) -> dict:
        state = torch.load(path, weights_only=False)["callbacks"]
        return next(v for k, v in state.items() if "Throughput" in k)

    first, again = tmp_path / "two.ckpt", tmp_path / "again.ckpt"
    trainer = csv_trainer(tmp_path, 0, 2)
    trainer.fit(Tokens())
    trainer.save_checkpoint(first)
    trainer = csv_trainer(tmp_path, 1, 4)
    trainer.callbacks.append(StopAtStart())
    trainer.fit(Tokens(), ckpt_path=first)
    assert trainer.global_step == 2
    trainer.save_checkpoint(again)
    before, after = monitor_state(first), monitor_state(again)
    assert before["time"] > 0 and after == before  # time, batches, samples, lengths, tokens


def test_a_later_fit_of_the_same_trainer_goes_on_from_the_earlier_ones_totals(tmp_path: Path) -> None:
    """A project of one's own that fit a Trainer to step 2, validated, and fit it on to 4 (max_steps raised, as for a
    next data stage): train/tokens was logged for the first fit only, and train/samples, train/lengths and
    train/time fell back to 0 at step 2, as a resume's did before it went on from the checkpoint's totals."""
    import csv

    class Validates(Tokens):
        def validation_step(self, batch, batch_idx):
            pass

        def val_dataloader(self):
            return self.train_dataloader()

    module, trainer = Validates(), csv_trainer(tmp_path, 0, 2)
    trainer.fit(module)
    trainer.validate(module, verbose=False)  # between the fits: it kept its own window
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")) if r.get("train/samples")]
    assert [float(r["train/samples"]) for r in rows] == [4.0, 8.0, 12.0, 16.0]  # were 4, 8, 4, 8
    assert [float(r["train/lengths"]) for r in rows] == [24.0, 48.0, 72.0, 96.0]
    assert [r.get("train/tokens") for r in rows] == ["24.0", "48.0", "72.0", "96.0"]  # were 24, 48, none, none
    times = [float(r["train/time"]) for r in rows]
    assert times == sorted(times) and times[2] > times[1]  # was 0.001 at step 2


def test_each_test_and_predict_run_counts_from_zero(tmp_path: Path) -> None:
    """Lightning resets its counts only inside fit: a second trainer.test() wrote test/batches 3, 4 and test/samples 12,
    16 for a test set of 2 batches of 4 (predict alike), beside a test/time that restarted at 0."""
    import csv

    class Tested(Tokens):
        def test_step(self, batch, batch_idx):
            self.log("test/loss", self.emb(batch["input_ids"]).square().mean())

        def predict_step(self, batch, batch_idx):
            return self.emb(batch["input_ids"])

        def test_dataloader(self):
            return DataLoader([{"input_ids": torch.zeros(6, dtype=torch.long)}] * 8, batch_size=4)

        predict_dataloader = test_dataloader

    trainer, module = csv_trainer(tmp_path, 0, 2), Tested()
    for _ in range(2):
        trainer.test(module, verbose=False)
        trainer.predict(module)
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    for stage in ("test", "predict"):
        counts = [(float(r[f"{stage}/batches"]), float(r[f"{stage}/samples"]))
                  for r in rows if r.get(f"{stage}/batches")]
        assert counts == [(1, 4), (2, 8), (1, 4), (2, 8)], (stage, counts)  # were (3, 12), (4, 16) the second time


def test_train_tokens_is_this_ranks_tokens_times_the_ranks(tmp_path: Path, monkeypatch) -> None:
    """train/tokens counts all ranks: this rank's tokens (train/lengths) times the world size, every rank training a
    batch of one shape. The world size is the Trainer's (2 here, in one process), not assumed 1."""
    import csv

    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))
    fit(Tokens(), tmp_path)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")) if r.get("train/samples")]
    assert [float(r["train/lengths"]) for r in rows] == [24.0, 48.0, 72.0, 96.0]  # 4 x 6 tokens a step, this rank
    assert [float(r["train/tokens"]) for r in rows] == [48.0, 96.0, 144.0, 192.0]
