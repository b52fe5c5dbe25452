"""Validation under 2-process DDP (gloo, CPU, 127.0.0.1) gives the single-process val loss of the same weights.

7 windows of source ``a`` on 2 ranks do not divide evenly, and source ``b`` has 1 window, fewer than the ranks.
Lightning's own ``DistributedSampler`` pads each rank's share by repeating windows, so ``a``'s first window used
to count twice.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port, leave_rank, make_corpus

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]

VAL_WINDOWS = 7  # source a: odd, so 2 ranks share it unevenly
VAL_KEYS = ("val/loss", "val/a/loss", "val/b/loss")


def _data(root: str):
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.data.corpus import CorpusSource

    sources = [CorpusSource(name=name, kind="files", paths=[os.path.join(root, name)]) for name in ("a", "b")]
    return LMDataModule(sources=sources, block_size=32, batch_size=4, val_batch_size=3, max_val_windows=VAL_WINDOWS,
                        cache_dir=os.path.join(root, "cache"), progress=False)


def _module():
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw

    torch.manual_seed(0)
    model = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32))
    return LitLLM(model, optimizer=lambda params: adamw(params, lr=1e-2), val_names=["a", "b"])


def _trainer(root: str, devices: int, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root, **kwargs)


def _val(metrics: dict) -> dict:
    return {k: float(metrics[k]) for k in VAL_KEYS}


def _worker(rank: int, port: int, root: str) -> None:
    """The ranks of both tests below, in one process group (a spawn per test started two fresh Pythons)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    _validate_and_fit(rank, os.path.join(root, "same"))
    _fit_on_own_corpus(rank, os.path.join(root, "own"))
    leave_rank()


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("val_exact")
    make_corpus(root / "same" / "a")
    make_corpus(root / "same" / "b", n_files=1, size=1200)  # its val split is one window
    dm = _data(str(root / "same"))
    dm.prepare_data()  # build the token caches once, before the ranks start
    dm.setup()
    make_corpus(root / "own" / "a")
    make_corpus(root / "own" / "b0", n_files=4)
    make_corpus(root / "own" / "b1", n_files=4)
    other = root / "own" / "b1" / "doc_003.txt"
    other.write_text(other.read_text()[::-1])  # rank 1's copy of corpus b differs (same size)
    mp.spawn(_worker, args=(free_port(), str(root)), nprocs=2, join=True)
    return root


def _predicted(out: list) -> list[dict]:
    """``trainer.predict``'s batches, per source: the windows' indices and their token losses."""
    return [{key: torch.cat([b[key] for b in batches]) for key in ("index", "token_loss")} for batches in out]


def _validate_and_fit(rank: int, root: str) -> None:
    lit = _module()
    predicted = _predicted(_trainer(root, 2).predict(lit, datamodule=_data(root)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validated = _trainer(root, 2).validate(lit, datamodule=_data(root), verbose=False)[0]
    # then a short fit: its validation runs through the DDP wrapper, on the weights the fit ends with
    trainer = _trainer(root, 2, max_steps=2, val_check_interval=2, check_val_every_n_epoch=None,
                       num_sanity_val_steps=0)
    trainer.fit(lit, datamodule=_data(root))
    torch.save({"validate": _val(validated), "fit": _val(trainer.callback_metrics), "predict": predicted,
                "warnings": [str(w.message) for w in caught if "DistributedSampler" in str(w.message)],
                "weights": {k: v.detach().clone() for k, v in lit.state_dict().items()}},
               os.path.join(root, f"rank{rank}.pt"))


def test_ddp_val_loss_is_the_single_process_val_loss(fitted: Path) -> None:
    tmp_path = fitted / "same"
    dm = _data(str(tmp_path))
    dm.prepare_data()
    dm.setup()
    assert [len(loader.dataset) for loader in dm.val_dataloader()] == [VAL_WINDOWS, 1]

    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))

    lit = _module()
    single = _val(_trainer(str(tmp_path), 1).validate(lit, datamodule=_data(str(tmp_path)), verbose=False)[0])
    lit.load_state_dict(r0["weights"])
    single_fitted = _val(_trainer(str(tmp_path), 1).validate(lit, datamodule=_data(str(tmp_path)), verbose=False)[0])
    for key in VAL_KEYS:
        assert r0["validate"][key] == r1["validate"][key]  # every rank logs the same reduced value
        assert r0["validate"][key] == pytest.approx(single[key], rel=1e-6, abs=1e-6), key
        assert r0["fit"][key] == pytest.approx(single_fitted[key], rel=1e-6, abs=1e-6), key
    assert single_fitted["val/loss"] != single["val/loss"]  # the fit moved the weights: a second, distinct check
    assert r0["warnings"] == []  # Lightning's "Using DistributedSampler ... during trainer.validate()" is gone


def test_ddp_predict_gives_each_validation_window_once(fitted: Path) -> None:
    """``trainer.predict`` shares the validation windows as validation does; the fillers that even out the ranks
    (source a: 7 windows, b: 1) are dropped, so the ranks' results are the single process's, each window once."""
    tmp_path = fitted / "same"
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["predict"] for r in (0, 1))
    single = _predicted(_trainer(str(tmp_path), 1).predict(_module(), datamodule=_data(str(tmp_path))))
    assert [len(s["index"]) for s in single] == [VAL_WINDOWS, 1]
    for source, one in enumerate(single):
        both = torch.cat([r0[source]["index"], r1[source]["index"]])
        order = both.argsort()
        assert both[order].tolist() == one["index"].tolist()  # each window once, none missing
        losses = torch.cat([r0[source]["token_loss"], r1[source]["token_loss"]])[order]
        torch.testing.assert_close(losses, one["token_loss"], rtol=1e-6, atol=1e-6)


def _fit_on_own_corpus(rank: int, root: str) -> None:
    """Rank r reads corpus ``b`` from ``<root>/b<r>``: another node's copy, which differs."""
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.data.corpus import CorpusError, CorpusSource

    sources = [CorpusSource(name="a", kind="files", paths=[os.path.join(root, "a")]),
               CorpusSource(name="b", kind="files", paths=[os.path.join(root, f"b{rank}")])]
    data = LMDataModule(sources=sources, block_size=32, batch_size=4, cache_dir=os.path.join(root, f"cache{rank}"),
                        progress=False)
    trainer = _trainer(root, 2, max_steps=2, num_sanity_val_steps=0)
    try:
        trainer.fit(_module(), datamodule=data)
        outcome = "trained"
    except CorpusError as e:
        outcome = str(e)
    torch.save({"outcome": outcome, "step": trainer.global_step}, os.path.join(root, f"own{rank}.pt"))


def test_ranks_that_read_different_corpora_are_refused_before_training(fitted: Path) -> None:
    """Each rank reads the corpus itself: another node's copy of a file (or another Python's standard library, the
    default corpus) gave the ranks other windows under the same indices, and the run trained on the mix silently.
    Every rank now stops in setup with a CorpusError naming the source and the ranks."""
    for rank in (0, 1):  # corpus b of rank 1 holds one file reversed (fixture fitted)
        result = torch.load(fitted / "own" / f"own{rank}.pt", weights_only=True)
        assert result["step"] == 0, result
        assert result["outcome"].startswith("the ranks read different data: rank 1 (host "), result
        assert "have other token caches of data source 'b'" in result["outcome"]
