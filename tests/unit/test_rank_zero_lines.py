"""Facts of the run are printed by rank 0 alone: every rank of a DDP run reads the same corpus and stops at the same
step, and each printed the same warning (a 2-rank trainer=ddp_cpu run printed 'too few documents for a by-document
val split' and 'data.val_fraction=0.3 holds out whole documents ... 86.1% of its tokens' twice, and 'stopped by SIGTERM
after the last step (N), whose last.ckpt is saved' twice). Each rank still makes the checks and returns the same."""

from __future__ import annotations

import logging
import signal
from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities import rank_zero_only

from lit_dtrain.data.corpus import CorpusError, CorpusSource
from lit_dtrain.data.split_report import warn_about_split
from lit_dtrain.data.token_cache import build_token_cache
from lit_dtrain.sigterm_exit import stopped_by_sigterm


def _lines(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_a_corpus_s_warnings_are_printed_by_rank_0_alone_and_every_rank_still_reads_it(tmp_path, caplog,
                                                                                       monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):  # too few documents for a by-document split of 33-token windows
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 200)
    (corpus / "blob.bin").write_bytes(b"\x00\x01" * 300)  # looks binary
    (corpus / "gone.txt").symlink_to(tmp_path / "missing.txt")  # a dangling symlink
    (corpus / ".hidden.txt").write_text("left out")
    src = CorpusSource(name="few", kind="files", paths=[str(corpus)])
    metas = {}
    for rank in (1, 0):  # rank 1 builds the cache here, rank 0 loads it: a reused cache warns too
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lit_dtrain.data.corpus"):
            metas[rank] = build_token_cache(src, tmp_path / "cache", 33, progress=False).meta
        lines = [m for m in _lines(caplog, "lit_dtrain.data.corpus") if m.startswith("data source")]
        if rank == 1:
            assert lines == []
    assert metas[0] == metas[1] and metas[0]["split"] == "by_tokens_tail"
    assert len(lines) == 4, lines
    assert "too few documents for a by-document val split" in "\n".join(lines)
    assert "1 file(s) look binary" in "\n".join(lines) and "1 symlink(s)" in "\n".join(lines)
    assert "left out 1 hidden file(s)" in "\n".join(lines)
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # rank 1 still checks: a bad path fails there too
    with pytest.raises(CorpusError, match="does not exist"):
        build_token_cache(CorpusSource(name="x", kind="files", paths=[str(tmp_path / "nope")]), tmp_path / "cache",
                          33, progress=False)


def test_an_unreadable_directory_is_told_by_rank_0_alone_and_every_rank_leaves_it_out(tmp_path, caplog,
                                                                                      monkeypatch):
    """A 2-rank run over a corpus with a directory it may not list printed 'cannot list .../locked (Permission
    denied): its files are left out' twice: every rank walks the corpus. (Refused by a stand-in for ``iterdir``:
    a test run as root may list a chmod-000 directory.)"""
    import os

    from lit_dtrain.data.corpus import resolve_files

    corpus = tmp_path / "corpus"
    (corpus / "locked").mkdir(parents=True)
    (corpus / "locked" / "hidden.txt").write_text("left out " * 50)
    (corpus / "doc.txt").write_text("kept " * 50)

    def refusing(listing):  # Path.iterdir lists with os.listdir, Path.glob with os.scandir
        def refuse(path="."):
            if os.path.basename(os.fspath(path).rstrip(os.sep)) == "locked":
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return listing(path)
        return refuse

    monkeypatch.setattr(os, "listdir", refusing(os.listdir))
    monkeypatch.setattr(os, "scandir", refusing(os.scandir))
    source = CorpusSource(name="text", kind="files", paths=[str(corpus)])
    for rank, count in ((1, 0), (0, 1)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.corpus"):
            assert [p.name for p in resolve_files(source)] == ["doc.txt"]
        said = [m for m in _lines(caplog, "lit_dtrain.data.corpus") if m.startswith("cannot list")]
        assert len(said) == count, said
    assert said == [f"cannot list {corpus / 'locked'} (Permission denied): its files are left out"]


def test_a_split_that_holds_out_far_more_is_warned_about_by_rank_0_alone(caplog, monkeypatch, tmp_path):
    meta = {"split": "by_document", "train_tokens": 139, "val_tokens": 861}
    for rank, count in ((1, 0), (0, 1)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.corpus"):
            warn_about_split("text", meta, 0.3, 33, [(tmp_path / "big.txt", 800)])
        assert len(_lines(caplog, "lit_dtrain.data.corpus")) == count
    assert "held out are 86.1% of its tokens" in caplog.text


@pytest.mark.parametrize("saved_last", [True, False])
def test_a_stop_by_sigterm_is_told_by_rank_0_alone_and_every_rank_exits_143(caplog, monkeypatch, saved_last):
    """The checkpoint saved (or none) is the run's: rank 0 says it. 'exiting with status 143' is each process's own
    exit (under torchrun or srun each rank's line tells that it ended by itself, not killed by the launcher), labelled
    with its rank as Lightning's per-process lines are: under torchrun both workers wrote the same unlabelled line to
    the one train.log."""
    trainer = SimpleNamespace(callbacks=[], global_step=6, world_size=2)
    for rank, count in ((1, 1), (0, 2)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
            assert stopped_by_sigterm(trainer, saved_last=saved_last) == 128 + signal.SIGTERM
        lines = _lines(caplog, "lit_dtrain.train")
        assert len(lines) == count
        assert lines[-1] == f"[rank: {rank}] exiting with status 143 (stopped by SIGTERM, not finished)"
    said = "after the last step (6), whose last.ckpt is saved" if saved_last else "at step 6 without a checkpoint"
    assert f"stopped by SIGTERM {said}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):  # one process: no rank to tell apart
        stopped_by_sigterm(SimpleNamespace(callbacks=[], global_step=6, world_size=1), saved_last=saved_last)
    assert _lines(caplog, "lit_dtrain.train")[-1] == "exiting with status 143 (stopped by SIGTERM, not finished)"


def test_a_corpus_of_fewer_windows_than_a_batch_and_a_wsd_without_decay_are_told_by_rank_0_alone(
    tmp_path, caplog, monkeypatch
):
    """A 2-rank run on 12 training windows (global batch 16) printed 'the training data holds 12 window(s) ...' twice,
    each under Lightning's 'call.py:199:' (a warnings.warn, not in train.log), and 'WSD: decay_fraction=0.2 of
    total_steps=2 rounds to 0 decay steps' twice. Every rank still binds its windows and builds the schedule."""
    import torch

    from lit_dtrain.data import LMDataModule
    from lit_dtrain.schedules.lr import wsd_scheduler

    (tmp_path / "tiny.txt").write_text("x" * 40)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for rank, count in ((1, 0), (0, 2)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        dm = LMDataModule(sources=[CorpusSource(name="tiny", kind="files", paths=[str(tmp_path / "tiny.txt")])],
                          block_size=16, batch_size=4, cache_dir=str(tmp_path / "cache"), progress=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            dm.prepare_data()
            dm.setup()
            sched = wsd_scheduler(opt, total_steps=2, decay_fraction=0.2)
        said = [r.getMessage() for r in caplog.records
                if "fewer than one global batch" in r.getMessage() or "rounds to 0 decay" in r.getMessage()]
        assert len(said) == count and len(dm.train_windows) == 1 and sched.lr_lambdas[0](1) == 1.0
    assert "holds 1 window(s) of block_size+1 = 17 tokens, fewer than one global batch of 4" in said[0]


def test_a_moved_run_dir_is_told_by_rank_0_alone_and_every_rank_reads_its_files_there(tmp_path, caplog, monkeypatch):
    """A 2-rank resume=auto of a copied run dir printed 'ModelCheckpoint: the checkpoint was saved in
    .../r6/checkpoints; its files are read in .../r6b/checkpoints (the run dir moved)' twice."""
    from lit_dtrain.callbacks.model_checkpoint import moved_dirpath_state

    old, new = tmp_path / "a", tmp_path / "b"
    new.mkdir()
    (new / "last.ckpt").write_bytes(b"x")
    state = {"dirpath": str(old), "last_model_path": str(old / "last.ckpt"), "best_k_models": {}}
    for rank, count in ((1, 0), (0, 1)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lit_dtrain.callbacks.model_checkpoint"):
            moved = moved_dirpath_state(state, str(new))
        assert moved["last_model_path"] == str(new / "last.ckpt") and len(caplog.records) == count
    assert "(the run dir moved)" in caplog.text


def test_a_decay_branch_and_init_from_are_told_by_rank_0_alone(tiny_cfg, tmp_path, caplog, monkeypatch):
    """A 2-rank decay branch printed 'decay_branch.ckpt ... is below its peak LR', 'resuming ... with optimizer.lr=0.001
    as the peak LR' and 'decay_branch: from step 55 of ..., decaying over 3 steps to step 58' twice; init_from
    'init_from: loaded 48 weight tensors from ...' twice. Every rank still sets the branch's keys and loads the
    weights."""
    import torch

    from lit_dtrain.models import build_llama
    from lit_dtrain.schedules.workflows import apply_decay_branch, load_model_weights

    src = tmp_path / "decayed.ckpt"  # a finished WSD run's step 55: its LR decayed to 0
    torch.save({"global_step": 55, "optimizer_states": [{"param_groups": [{"lr": 0.0}]}],
                "lr_schedulers": [{"base_lrs": [0.003]}], "state_dict": {}}, src)
    model = build_llama(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16)
    torch.save({"global_step": 3, "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}},
               tmp_path / "weights.ckpt")
    for rank, count in ((1, 0), (0, 5)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        cfg = tiny_cfg(f"decay_branch.ckpt={src}", "decay_branch.steps=3", "optimizer.lr=0.001", run="branch")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lit_dtrain.schedules.workflows"):
            assert apply_decay_branch(cfg) == 55
            assert len(load_model_weights(model, tmp_path / "weights.ckpt")) == len(model.state_dict())
        said = _lines(caplog, "lit_dtrain.schedules.workflows")
        assert len(said) == count, said
        assert cfg.trainer.max_steps == 58 and cfg.ckpt_path == str(src)
    # the branch's 3 steps fall between trainer.log_every_n_steps=10's steps: it says how often it logs instead
    assert sum("it logs every 2 steps instead" in line for line in said) == 1
    said = [line for line in said if "it logs every 2 steps instead" not in line]
    assert "is below its peak LR" in said[0] and "with optimizer.lr=0.001 as the peak LR" in said[1]
    assert "decaying over 3 steps to step 58" in said[2] and "init_from: loaded" in said[3]


def test_a_sampler_s_required_callback_is_added_on_every_rank_and_told_by_rank_0(caplog, monkeypatch):
    """data/sampler=fourier on 2 ranks printed 'adding FourierSamplerCallback (required by FourierSampler)' twice."""
    import lightning as L

    from lit_dtrain.train_callbacks import add_required_callbacks

    class Needed(L.Callback):
        pass

    class Sampler:
        def required_callbacks(self):
            return [Needed()]

    for rank, count in ((1, 0), (0, 1)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        callbacks = []
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
            add_required_callbacks(callbacks, Sampler())
            add_required_callbacks(callbacks, Sampler())  # there already: not again
        assert [type(c) for c in callbacks] == [Needed] and len(caplog.records) == count
    assert caplog.records[0].getMessage() == "adding Needed (required by Sampler)"


def test_a_cut_top_k_is_told_by_rank_0_alone_and_every_rank_cuts_it(caplog, monkeypatch):
    """A resume with a lower save_top_k: each rank cut the restored top-k and printed 'ModelCheckpoint: save_top_k=1,
    and the checkpoint's top-k holds 3 files: removing ...'."""
    from lit_dtrain.callbacks.model_checkpoint import keep_top_k

    for rank, count in ((1, 0), (0, 1)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        callback = SimpleNamespace(save_top_k=1, mode="min", best_k_models={"/c/a.ckpt": 3.0, "/c/b.ckpt": 2.0,
                                                                             "/c/c.ckpt": 4.0})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.callbacks.model_checkpoint"):
            assert keep_top_k(callback) == ["/c/a.ckpt", "/c/c.ckpt"]
        assert callback.best_model_path == "/c/b.ckpt" and len(caplog.records) == count
    said = "ModelCheckpoint: save_top_k=1, and the checkpoint's top-k holds 3 files: removing a.ckpt, c.ckpt"
    assert caplog.records[0].getMessage() == said
