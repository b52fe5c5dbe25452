"""A mixture logs each source's share of the windows drawn so far (``data/share/<name>``): the shares of the indices
the batches really held, through each logged step's last micro-batch, and the same values after a resume."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_dtrain.callbacks import token_throughput_monitor
from lit_dtrain.data import LMDataModule
from lit_dtrain.data.corpus import CorpusSource
from tests.conftest import make_corpus


class Embed(L.LightningModule):
    """A tiny model over the batch contract that records every micro-batch's sample indices."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.seen = torch.nn.Embedding(256, 4), []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["index"].clone())
        return self.emb(batch["input_ids"]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def mixture(tmp_path: Path) -> LMDataModule:
    for name, seed in (("a", 1), ("b", 2)):
        if not (tmp_path / name).exists():
            make_corpus(tmp_path / name, n_files=4, seed=seed)
    sources = [CorpusSource(name="old", kind="files", paths=[str(tmp_path / "a")], weight=20),
               CorpusSource(name="new", kind="files", paths=[str(tmp_path / "b")], weight=80)]
    return LMDataModule(sources=sources, cache_dir=str(tmp_path / "cache"), progress=False, block_size=32, batch_size=4)


def fit(tmp_path: Path, version: int, max_steps: int, ckpt_path=None) -> tuple[L.Trainer, Embed, LMDataModule]:
    module, dm = Embed(), mixture(tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=2,
                        callbacks=[token_throughput_monitor(window_size=2)], log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="csv", version=version), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, module, dm


def shares(tmp_path: Path, version: int) -> dict[int, tuple[float, float]]:
    rows = csv.DictReader(open(tmp_path / "csv" / f"version_{version}" / "metrics.csv"))
    return {int(r["step"]): (float(r["data/share/old"]), float(r["data/share/new"]))
            for r in rows if r.get("data/share/old")}


def test_shares_are_those_of_the_drawn_indices_through_each_step(tmp_path: Path) -> None:
    _, module, dm = fit(tmp_path, 0, max_steps=4)
    old_windows = int(dm.train_windows.counts[0])  # indices below this are the source 'old''s
    assert len(module.seen) == 8  # 4 steps x 2 micro-batches
    expected = {}
    for step in range(4):
        drawn = torch.cat(module.seen[: 2 * (step + 1)])  # through the step's last micro-batch
        old = float((drawn < old_windows).sum()) / len(drawn)
        expected[step] = (old, 1 - old)
    got = shares(tmp_path, 0)
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-12)
    assert 0 < got[3][0] < 0.5  # weight 20 of 100: the old source is the smaller share
    assert dm.state_dict()["drawn_per_source"] == {"old": int(round(got[3][0] * 32)), "new": int(round(got[3][1] * 32))}


def test_a_resume_goes_on_from_the_checkpoints_counts(tmp_path: Path) -> None:
    """From the resumed step on the shares were those of the resumed run's own draws (0/1 counts from zero)."""
    fit(tmp_path, 0, max_steps=4)
    trainer, _, _ = fit(tmp_path, 1, max_steps=2)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    fit(tmp_path, 2, max_steps=4, ckpt_path=tmp_path / "step2.ckpt")
    whole, resumed = shares(tmp_path, 0), shares(tmp_path, 2)
    assert sorted(resumed) == [2, 3] and all(resumed[s] == whole[s] for s in resumed)  # bitwise: the same floats


def test_a_checkpoint_without_counts_logs_no_share_after_a_resume(tmp_path: Path) -> None:
    dm = mixture(tmp_path)
    dm.prepare_data()
    dm.setup()
    state = {k: v for k, v in dm.state_dict().items() if k != "drawn_per_source"}
    dm.load_state_dict({**state, "micro_step": 6})  # written before the counts were kept, 6 micro-batches in
    assert dm.drawn_windows is None
    dm.next_train_batch()
    assert dm.state_dict()["drawn_per_source"] is None
    dm.load_state_dict(state)  # one that drew nothing: from zero
    assert np.array_equal(dm.drawn_windows, [0, 0])


def test_every_rank_counts_the_global_batch(tmp_path: Path) -> None:
    """2 ranks of batch 4 count what 1 process of batch 8 draws (every rank draws the global batch and takes its
    shard), so rank 0 logs all ranks' shares with no collective; a rank's own shard alone would count 4 a step."""
    from types import SimpleNamespace

    counts = []
    for rank, world, batch_size in ((0, 2, 4), (1, 2, 4), (0, 1, 8)):
        dm = mixture(tmp_path)
        dm.batch_size = batch_size
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=world, overfit_batches=0, accumulate_grad_batches=1)
        dm.prepare_data()
        dm.setup()
        shards = [dm.next_train_batch()["index"] for _ in range(5)]
        assert all(len(s) == batch_size for s in shards)
        counts.append(dm.drawn_windows.tolist())
    assert counts[0] == counts[1] == counts[2] and sum(counts[0]) == 40
