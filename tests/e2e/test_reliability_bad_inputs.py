"""The reliability matrix (docs/reliability.md), its bad inputs: a corrupt, truncated or foreign checkpoint, a bad
corpus file, a non-finite loss, a full disk, each reported as one clear error or survived; nothing lost. (The process
faults are in test_reliability.py.)"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.module import NonFiniteError
from lit_dtrain.run_dirs import TRAINING_STARTS
from lit_dtrain.train import train
from tests.conftest import ROOT
from tests.e2e._reliability_helpers import train_proc


def test_corrupt_or_truncated_checkpoint_is_named(tiny_cfg, tmp_path):
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", run="good"))
    good = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    data = good.read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 10)
    for bad in (truncated, garbage):
        with pytest.raises(CheckpointError, match=str(bad.name)):
            train(tiny_cfg("sample.max_new_tokens=0", f"ckpt_path={bad}", run=f"resume_{bad.stem}"))


@pytest.mark.parametrize("kind", ["config", "corpus", "checkpoint"])
def test_a_bad_input_is_one_error_line_without_a_traceback(tmp_path, corpus, kind):
    """`python train.py data.seed=abc` printed Hydra's shortened traceback, about a dozen lines of lit_dtrain frames
    with the message last (a corpus error came inside 'Error in call to target ... full_key: data'). A bad config,
    corpus or checkpoint is now one line on stderr, 'error: <message>', with exit status 1 as before."""
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 10)
    args, message = {
        "config": (["data.seed=abc"], "error: data.seed must be an integer, got 'abc' (str)"),
        "corpus": (["data.sources.0.paths=[]"], "error: data.sources.0 (data source 'text'): kind='files' needs a "
                   "non-empty 'paths' list of files, directories or globs, e.g. 'data.sources.0.paths=[\"~/corpus\"]'"),
        "checkpoint": ([f"ckpt_path={garbage}"], f"error: checkpoint '{garbage}' is "),
    }[kind]
    proc = train_proc(tmp_path, corpus, *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(message), proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if "rror" in line] == [proc.stderr.splitlines()[-1]]


def test_a_non_finite_stop_is_one_line_and_its_traceback_is_in_the_runs_log(tmp_path, corpus):
    """A run that stops on a non-finite gradient (NonFiniteError, whose message names the step and the tensors)
    printed Hydra's traceback (some 78 lines, mostly Lightning's), and its train.log said nothing of it. It is one
    line now, exit status 1, and the run's train.log holds 'run failed: NonFiniteError: ...' with the traceback
    (which scripts/compare_runs.py shows as the run's error). Other errors keep their traceback on the console
    (tests/unit/test_sweep_error_reports.py::test_a_bad_input_is_reported_in_one_line_and_other_errors_keep_their_traceback)."""
    proc = train_proc(tmp_path, corpus, "optimizer.lr=1e30", "trainer.max_steps=3", "run_name=nf")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith("error: non-finite gradients at step 1 "), proc.stderr[-3000:]
    log = (tmp_path / "outputs" / "runs" / "nf" / "train.log").read_text()
    assert "[ERROR] - run failed: NonFiniteError: non-finite gradients at step 1 " in log
    assert log.index(f"[INFO] - {TRAINING_STARTS}\n") < log.index("run failed")  # only errors after it count
    assert "Traceback (most recent call last)" in log
    assert "lit_dtrain.module.NonFiniteError: non-finite gradients at step 1" in log


def test_nonfinite_loss_stops_at_that_step_with_finite_weights(tiny_cfg):
    for value in ("nan", "inf"):
        cfg = tiny_cfg("+callbacks.fault._target_=tests.faults.PoisonLossAtStep", "+callbacks.fault.step=3",
                       f"+callbacks.fault.value={value}", run=f"nan_{value}")
        with pytest.raises(NonFiniteError, match="step 3") as info:
            train(cfg)
        assert "weights are still finite" in str(info.value)


def test_nonfinite_guard_leaves_weights_finite(tiny_cfg):
    import lightning as L
    from hydra.utils import instantiate

    from lit_dtrain.module import LitLLM
    from tests.faults import PoisonLossAtStep

    cfg = tiny_cfg(run="nan_weights")
    dm = instantiate(cfg.data, _convert_="all")
    module = LitLLM(instantiate(cfg.model), instantiate(cfg.optimizer), None)
    trainer = L.Trainer(max_steps=6, callbacks=[PoisonLossAtStep(2)], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, accelerator="cpu")
    with pytest.raises(NonFiniteError):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2
    assert all(bool(p.isfinite().all()) for p in module.parameters())


def test_disk_full_during_training_reports_and_keeps_last_checkpoint(tiny_cfg, tmp_path):
    mnt = tmp_path / "ckpt_tmpfs"
    mnt.mkdir()
    assert subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode == 0
    try:
        cfg = tiny_cfg(f"paths.checkpoint_dir={mnt}", "trainer.val_check_interval=2", "sample.max_new_tokens=0",
                       "+callbacks.fault._target_=tests.faults.FillDiskAtStep", "+callbacks.fault.step=3",
                       f"+callbacks.fault.path={mnt}", run="diskfull")
        with pytest.raises(CheckpointError, match="No space left on device"):
            train(cfg)
        ckpt = torch.load(mnt / "last.ckpt", weights_only=True)
        assert ckpt["global_step"] == 2  # the previous checkpoint is intact
        assert not list(mnt.glob(".*tmp*"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def _write_bad_corpus(root: Path, kind: str) -> Path:
    from tests.conftest import make_corpus

    root = make_corpus(root, n_files=8)
    if kind == "empty_files":
        for i in range(3):
            (root / f"empty_{i}.txt").write_bytes(b"")
    elif kind == "binary_junk":
        (root / "junk.bin").write_bytes(bytes(random.Random(0).randbytes(50_000)))
    return root


@pytest.mark.parametrize("kind", ["empty_files", "binary_junk"])
def test_bad_files_in_corpus_still_train(tmp_path, kind):
    from tests.conftest import compose_cfg

    corpus = _write_bad_corpus(tmp_path / kind, kind)
    metrics, objs = train(compose_cfg(["sample.max_new_tokens=0"], tmp_path / "run", corpus))
    assert metrics["steps"] == 6 and metrics["val_loss"] < 6.0
    assert objs["datamodule"].splits[0].meta["documents"] == 8 + (1 if kind == "binary_junk" else 0)


@pytest.mark.slow
def test_single_100mb_line(tmp_path):
    from lit_dtrain.data import CorpusSource, LMDataModule

    big = tmp_path / "one_line.txt"
    with open(big, "wb") as f:
        chunk = b"x = 1; " * 1024
        for _ in range(100 * 1024 * 1024 // len(chunk) + 1):
            f.write(chunk)
    dm = LMDataModule([CorpusSource(name="big", kind="files", paths=[str(big)])], block_size=64, batch_size=4,
                      cache_dir=str(tmp_path / "cache"), progress=False)
    dm.prepare_data()
    dm.setup()
    assert dm.num_train_samples > 1_000_000
    assert dm.batch_for_step(0)["input_ids"].shape == (4, 64)


def test_changed_corpus_rebuilds_cache_and_unreadable_is_named(tiny_cfg, corpus, tmp_path, monkeypatch):
    _, first = train(tiny_cfg("sample.max_new_tokens=0", run="c1"))
    (corpus / "doc_003.txt").write_text("brand new text " * 500)
    _, second = train(tiny_cfg("sample.max_new_tokens=0", run="c2"))
    assert first["datamodule"].splits[0].train.filename != second["datamodule"].splits[0].train.filename
    import builtins

    from lit_dtrain.data import CorpusError

    real_open = builtins.open
    bad = str(corpus / "doc_005.txt")

    def deny(path, *a, **k):  # root ignores file modes, so simulate EACCES
        if str(path) == bad:
            raise PermissionError(13, "Permission denied", bad)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(CorpusError, match="doc_005.txt.*Permission denied"):
        train(tiny_cfg("sample.max_new_tokens=0", run="c3"))


def test_checkpoint_that_is_not_a_training_checkpoint_is_named(tiny_cfg, tmp_path):
    """A readable torch file that is not a Lightning checkpoint, or one of another model shape: CheckpointError
    naming the file (it was a raw KeyError / TypeError / IndexError, or a state_dict RuntimeError)."""
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2",
                             "model.d_model=64", run="wide"))
    wide = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    state = torch.load(wide, weights_only=True)["state_dict"]
    bad = {"plain_state_dict": state, "a_tensor": torch.zeros(3), "a_list": [1, 2],
           "no_state_dict": {"global_step": 2}}
    for name, obj in bad.items():
        path = tmp_path / f"{name}.ckpt"
        torch.save(obj, path)
        with pytest.raises(CheckpointError, match=f"{name}.ckpt' is not a Lightning training checkpoint"):
            train(tiny_cfg("sample.max_new_tokens=0", f"ckpt_path={path}", run=f"resume_{name}"))
    with pytest.raises(CheckpointError, match="last.ckpt' does not fit the configured model"):
        train(tiny_cfg("sample.max_new_tokens=0", f"ckpt_path={wide}", run="resume_wide"))


def test_resume_auto_without_last_ckpt_continues_from_the_newest_checkpoint(tiny_cfg):
    """Killed while writing the first last.ckpt (ModelCheckpoint writes the step file first): resume=auto used to
    refuse with 'continue it with resume=auto'; it now resumes from the step file and ends like a straight run."""
    straight, _ = train(tiny_cfg("sample.max_new_tokens=0", run="straight"))
    keep_all = "callbacks.model_checkpoint.save_top_k=-1"
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", keep_all, run="killed"))
    ckpt_dir = Path(objs["trainer"].default_root_dir) / "checkpoints"
    for p in ckpt_dir.glob("*.ckpt"):  # leave what a SIGKILL before the first last.ckpt's rename leaves
        if not p.name.startswith("step000003"):
            p.unlink()
    (ckpt_dir / "garbage.ckpt").write_bytes(b"junk")  # an unreadable file is skipped, not picked
    stale = ckpt_dir / ".last.ckpt.tmp-999999"  # the half-written file the kill left; as large as a checkpoint
    stale.write_bytes(b"x" * 1000)
    assert [p.name for p in ckpt_dir.glob("step*.ckpt")]
    resumed, _ = train(tiny_cfg("sample.max_new_tokens=0", keep_all, "resume=auto", run="killed"))
    assert resumed["steps"] == straight["steps"] == 6
    assert resumed["val_loss"] == straight["val_loss"]
    assert not stale.exists() and not list(ckpt_dir.glob(".*.tmp-*"))  # removed, not left to fill the disk


@pytest.mark.parametrize("content", ["empty", "truncated", "garbage", "tensor"])
def test_bad_decay_branch_checkpoint_is_named(tiny_cfg, tmp_path, content):
    """decay_branch.ckpt went through a bare torch.load: a damaged file was a raw torch RuntimeError."""
    from lit_dtrain.schedules.workflows import apply_decay_branch
    from lit_dtrain.train import ConfigError

    path = tmp_path / f"{content}.ckpt"
    if content == "tensor":
        torch.save(torch.zeros(3), path)
    elif content == "truncated":
        torch.save({"global_step": 3, "state_dict": {"w": torch.zeros(1000)}}, path)
        path.write_bytes(path.read_bytes()[:2000])
    else:
        path.write_bytes(b"" if content == "empty" else b"not a checkpoint" * 10)
    cfg = tiny_cfg(f"decay_branch.ckpt={path}", "decay_branch.steps=2", "scheduler.warmup_steps=0", run="branch")
    with pytest.raises((CheckpointError, ConfigError), match=f"{content}.ckpt"):
        apply_decay_branch(cfg)


@pytest.mark.parametrize("script", ["generate", "spectrum"])
def test_scripts_refuse_checkpoints_without_their_weights(tiny_cfg, tmp_path, capsys, script):
    """scripts/generate.py loaded with strict=False: a checkpoint with an empty state_dict sampled from a random
    init without a word; a tensor or a dict without state_dict was a raw RuntimeError/KeyError."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_{script}", ROOT / "scripts" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2"))
    good = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    mod.load_model(str(good))  # a real checkpoint loads strictly
    ckpt = torch.load(good, weights_only=True)
    bad = {"empty_state_dict": {**ckpt, "state_dict": {}}, "a_tensor": torch.zeros(3),
           "no_state_dict": {k: v for k, v in ckpt.items() if k != "state_dict"}}
    for name, obj in bad.items():
        path = tmp_path / f"{name}.ckpt"
        torch.save(obj, path)
        with pytest.raises(SystemExit):
            mod.load_model(str(path))
        assert f"{name}.ckpt" in capsys.readouterr().err  # and the last stdout line is the JSON error
