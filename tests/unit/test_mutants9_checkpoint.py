"""Exact results of ``checkpoint.py`` where single-point mutants passed test_checkpoint_loads.py,
test_checkpoint_io.py, test_atomic_write.py, test_checkpoint_crc.py and the weight-loading tests (ninth hand mutation
audit): the file a directory given for a checkpoint is told to give (its ``last.ckpt`` first, in it or in its
``checkpoints/``, else the newest), a link to a device, which is no broken link, the once-per-file CRC read, a dict
without ``state_dict``, the module's first mismatched key, and a skipped non-finite save warned once per step."""

from __future__ import annotations

import os

from lit_dtrain.checkpoint import not_a_file_reason


def test_a_directory_is_told_its_last_ckpt_else_its_newest_checkpoint(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    old, new = ckpts / "step000002.ckpt", ckpts / "step000004.ckpt"
    for i, path in enumerate((old, new)):
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))
    said = not_a_file_reason(tmp_path / "run")
    assert said == f"is a directory, not a checkpoint file; give a file in it, e.g. {str(new)!r}"
    (ckpts / "last.ckpt").write_bytes(b"x")
    os.utime(ckpts / "last.ckpt", (10, 10))  # older than both: last.ckpt is named for what it is, not its time
    assert not_a_file_reason(ckpts).endswith(f"e.g. {str(ckpts / 'last.ckpt')!r}")
    assert "it holds none (no *.ckpt in it or in its checkpoints/)" in not_a_file_reason(tmp_path)


def test_a_link_to_a_device_is_not_a_broken_link(tmp_path):
    (tmp_path / "null.ckpt").symlink_to(os.devnull)
    said = not_a_file_reason(tmp_path / "null.ckpt")
    assert said == "is not a regular file (a device, FIFO or socket); give a checkpoint file"
    (tmp_path / "gone.ckpt").symlink_to(tmp_path / "nowhere")
    assert not_a_file_reason(tmp_path / "gone.ckpt") == f"is a broken symbolic link (to {str(tmp_path / 'nowhere')!r})"


def test_an_intact_file_is_read_whole_once_until_it_is_rewritten(tmp_path, monkeypatch):
    """``verify_checkpoint`` remembers a file it read whole and found intact (the resume's few-key reads and its
    load then read it once, docs/reliability.md row 4c); a rewritten file (other size or time) is read again."""
    import torch

    import lit_dtrain.checkpoint as checkpoint

    path = tmp_path / "a.ckpt"
    torch.save({"w": torch.ones(4)}, path)
    reads = []
    real = checkpoint.damage_reason
    monkeypatch.setattr(checkpoint, "damage_reason", lambda p: reads.append(p) or real(p))
    checkpoint.verify_checkpoint(path)
    checkpoint.verify_checkpoint(path)
    assert len(reads) == 1
    torch.save({"w": torch.ones(8)}, path)
    checkpoint.verify_checkpoint(path)
    assert len(reads) == 2


def test_a_dict_with_a_step_but_no_state_dict_is_no_training_checkpoint(tmp_path):
    import pytest
    import torch

    from lit_dtrain.checkpoint import CheckpointError, checkpoint_global_step

    torch.save({"global_step": 3, "weights": {}}, tmp_path / "s.ckpt")
    with pytest.raises(CheckpointError, match=r"it holds a dict with keys \['global_step', 'weights'\], without"):
        checkpoint_global_step(tmp_path / "s.ckpt")


def test_the_first_shape_mismatch_named_is_the_modules_first():
    import torch

    from lit_dtrain.checkpoint import state_dict_mismatch

    expected = {"a": torch.zeros(2), "b": torch.zeros(3)}
    weights = {"b": torch.zeros(4), "a": torch.zeros(5)}  # the file's order is not the module's
    assert state_dict_mismatch(weights, expected) == ("'a' is [5] in the checkpoint, [2] in the model (2 of 2 tensors "
                                                      "differ in shape)")


def test_a_skipped_non_finite_save_is_warned_once_per_file_and_step(tmp_path, caplog):
    import torch

    from lit_dtrain.checkpoint import AtomicCheckpointIO

    io = AtomicCheckpointIO(["w"])
    nan = {"state_dict": {"w": torch.tensor([float("nan")])}, "global_step": 5}
    with caplog.at_level("WARNING", logger="lit_dtrain.checkpoint"):
        for step in (5, 5, 6):
            io.save_checkpoint({**nan, "global_step": step}, tmp_path / "last.ckpt")
    said = [r.getMessage() for r in caplog.records]
    assert [("at step 5" in m, "at step 6" in m) for m in said] == [(True, False), (False, True)]
    assert not (tmp_path / "last.ckpt").exists()
