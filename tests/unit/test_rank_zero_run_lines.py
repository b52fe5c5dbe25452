"""A run's end and a resume's schedule are facts of the run: every rank reaches them, and each printed its line (a
2-rank trainer=ddp_cpu run that diverged printed 'the run DIVERGED from step 2 on ...' twice, on the console and in
each rank's log). They are logged by rank 0 alone now (``utils.rank_zero.log_once``); every rank still does the work."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities import rank_zero_only

from lit_dtrain.callbacks import WSDScheduler
from lit_dtrain.divergence import report_divergence
from lit_dtrain.module import LitLLM
from lit_dtrain.schedules.lr import StepLambdaLR


def _lines(caplog, logger: str, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and text in r.getMessage()]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_diverged_run_is_told_by_rank_0_alone_and_every_rank_records_it(tmp_path, caplog, monkeypatch, rank):
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    module = torch.nn.Linear(2, 2)
    with torch.no_grad():
        module.weight[0, 0] = float("nan")
    metrics = {"val_loss": float("nan"), "checkpoint": str(tmp_path / "last.ckpt")}
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        report_divergence(metrics, module, None, tmp_path)
    assert metrics["diverged"] is True and metrics["checkpoint"] is None  # every rank: no finite checkpoint
    assert len(_lines(caplog, "lit_dtrain.train", "the run DIVERGED")) == (1 if rank == 0 else 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_wsd_callback_s_resume_lines_are_rank_0_s(caplog, monkeypatch, rank):
    """A changed schedule (loaded state) and changed peaks (fit start): each rank takes them, rank 0 says so."""
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    cb = WSDScheduler(total_steps=32, warmup_steps=2, decay_steps=8)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.callbacks.wsd"):
        cb.load_state_dict({**cb.state_dict(), "base_lrs": [[1.0]], "total_steps": 24, "decay_steps": 6})
        cb.on_fit_start(SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[]), None)
    assert cb.base_lrs == [[0.5]] and cb.total_steps == 32
    lines = _lines(caplog, "lit_dtrain.callbacks.wsd", "WSDScheduler")
    assert len(lines) == (2 if rank == 0 else 0), lines


@pytest.mark.parametrize("rank", [0, 1])
def test_a_scheduler_moved_to_the_resumed_step_is_told_by_rank_0_alone(caplog, monkeypatch, rank):
    """A checkpoint without scheduler state (written with the WSDScheduler callback): every rank moves its schedule
    to the restored step, rank 0 says so."""
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = StepLambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    trainer = SimpleNamespace(optimizers=[], global_step=4, lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    module = SimpleNamespace(trainer=trainer, model=torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.module"):
        LitLLM.on_train_start(module)
    assert scheduler.last_epoch == 4 and optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert len(_lines(caplog, "lit_dtrain.module", "LR scheduler at step 0")) == (1 if rank == 0 else 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_corpus_s_empty_files_and_copies_are_told_by_rank_0_alone(tmp_path, caplog, monkeypatch, rank):
    """'skipped 28 empty file(s)' and '19 file(s) have the same bytes as another file' of the default corpus were
    printed by each rank of a 2-rank run (the corpus's other warnings were rank 0's already)."""
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.token_cache import build_token_cache

    monkeypatch.setattr(rank_zero_only, "rank", rank)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 100)
    (corpus / "copy.txt").write_text("document 0 " * 100)
    (corpus / "empty.txt").write_text("")
    with caplog.at_level(logging.INFO, logger="lit_dtrain.data.corpus"):
        meta = build_token_cache(CorpusSource(name="t", kind="files", paths=[str(corpus)]), tmp_path / "cache", 33,
                                 progress=False).meta
    assert meta["train_tokens"] > 0  # every rank reads it
    lines = _lines(caplog, "lit_dtrain.data.corpus", "empty file") + _lines(caplog, "lit_dtrain.data.corpus",
                                                                             "have the same bytes")
    assert len(lines) == (2 if rank == 0 else 0), lines


@pytest.mark.parametrize("rank", [0, 1])
def test_the_summary_s_unigram_entropy_is_counted_by_rank_0_alone(rank):
    """Every rank of a 2-rank gloo run counted the whole train split at the end (0.43 s on rank 1 for stdlib's 31 M
    tokens, a pass over the corpus for a large one), where only rank 0 writes summary.json."""
    from lit_dtrain.train import summary_entropy

    counted = []
    datamodule = SimpleNamespace(unigram_entropy=lambda: counted.append(rank) or 3.25)
    value = summary_entropy(SimpleNamespace(is_global_zero=rank == 0), datamodule)
    assert (value, counted) == ((3.25, [0]) if rank == 0 else (None, []))
