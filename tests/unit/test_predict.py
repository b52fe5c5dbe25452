"""``trainer.predict`` with ``LMDataModule`` and ``LitLLM``: each held-out window's loss, once."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.data.corpus import CorpusSource
from lit_dtrain.data.datamodule import LMDataModule
from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM
from lit_dtrain.module_metrics import window_losses


def data(tmp_path: Path, names=("text",)) -> LMDataModule:
    sources = []
    for k, name in enumerate(names):
        corpus = tmp_path / f"{name}.txt"
        corpus.write_text("".join(f"{name} line {i}: the quick brown fox {k} jumps over\n" for i in range(150)))
        sources.append(CorpusSource(name=name, kind="files", paths=[str(corpus)]))
    return LMDataModule(sources=sources, block_size=16, batch_size=4, val_fraction=0.1, max_val_windows=10,
                        cache_dir=str(tmp_path / "cache"), progress=False)


def trainer(tmp_path: Path) -> L.Trainer:
    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(tmp_path), accelerator="cpu", devices=1)


@pytest.mark.parametrize("names", [("text",), ("a", "b")])
def test_predict_gives_each_validation_windows_loss_and_their_mean_is_val_loss(tmp_path: Path, names) -> None:
    torch.manual_seed(0)
    dm = data(tmp_path, names)
    module = LitLLM(build_llama(vocab_size=257, d_model=32, n_layer=1, n_head=2, block_size=16), val_names=list(names))
    t = trainer(tmp_path)
    out = t.predict(module, datamodule=dm)
    val = t.validate(module, datamodule=dm, verbose=False)[0]
    per_source = out if len(names) > 1 else [out]  # Lightning returns a flat list for one loader
    assert len(per_source) == len(names)
    tokens = []
    for batches in per_source:
        index = torch.cat([b["index"] for b in batches])
        assert index.tolist() == sorted(set(index.tolist())) and len(index) == 10  # max_val_windows, each once
        loss = torch.cat([b["loss"] for b in batches])
        token_loss = torch.cat([b["token_loss"] for b in batches])
        assert token_loss.shape == (10, 16)
        torch.testing.assert_close(loss, token_loss.mean(dim=1))
        tokens.append(token_loss.flatten())
    assert float(torch.cat(tokens).mean()) == pytest.approx(val["val/loss"], rel=1e-5)


def test_window_losses_drop_the_fillers_that_even_out_the_ranks() -> None:
    token_loss = torch.tensor([[1.0, 3.0], [5.0, 7.0], [9.0, 11.0]])
    batch = {"index": torch.tensor([4, 5, 4]), "loss_weight": torch.tensor([1.0, 1.0, 0.0])}
    out = window_losses(token_loss, batch)
    assert out["index"].tolist() == [4, 5]
    assert out["loss"].tolist() == [2.0, 6.0]
    assert out["token_loss"].shape == (2, 2)


def test_predict_counts_the_forward_flops_of_its_batches(tmp_path: Path) -> None:
    # predict/device/flops_per_sec read flops_per_batch as the last batch left it: none before a fit, and the train
    # batch's forward + backward (3x) after one
    from lit_dtrain.module_params import estimate_train_flops

    torch.manual_seed(0)
    model = build_llama(vocab_size=257, d_model=32, n_layer=1, n_head=2, block_size=16)
    module = LitLLM(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), val_names=["text"])
    forward = estimate_train_flops(model, 2, 16) / 3  # the last batch: 2 of the 10 windows (4, 4, 2), 16 tokens
    dm = data(tmp_path)
    trainer(tmp_path).predict(module, datamodule=dm)
    assert module.flops_per_batch == forward
    module.flops_per_batch = 3 * forward  # as a train batch leaves it
    trainer(tmp_path).predict(module, datamodule=dm)
    assert module.flops_per_batch == forward
