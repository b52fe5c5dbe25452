"""resume=auto resumes from the newest complete checkpoint of the run dir. ModelCheckpoint writes a new best step file
before last.ckpt, so a kill in between (seen in 1 of 10 SIGKILLs of a real run) leaves last.ckpt a validation
behind: resuming from it redid those steps, saved the step file again as '<name>-v1.ckpt' and left the first one in
the dir for good (the resumed ModelCheckpoint did not know it, so save_top_k never removed it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.train import resolve_ckpt_path, train


def _cfg(ckpt_dir: Path):
    return OmegaConf.create({"ckpt_path": None, "resume": "auto", "run_name": "r",
                             "paths": {"checkpoint_dir": str(ckpt_dir), "output_dir": str(ckpt_dir.parent)}})


def _save(path: Path, step: int) -> None:
    torch.save({"global_step": step, "state_dict": {}}, path)


def test_resume_auto_takes_the_newest_readable_checkpoint_last_ckpt_among_equals(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    _save(d / "last.ckpt", 2)
    _save(d / "step000002-val4.0000.ckpt", 2)
    assert resolve_ckpt_path(_cfg(d)) == str(d / "last.ckpt")  # equal steps: last.ckpt
    _save(d / "step000004-val3.5000.ckpt", 4)  # written, then killed before last.ckpt
    (d / ".last.ckpt.tmp-123").write_bytes(b"PK\x03\x04 half")  # the kill's temp file: never a candidate
    assert resolve_ckpt_path(_cfg(d)) == str(d / "step000004-val3.5000.ckpt")
    (d / "step000006-val3.0000.ckpt").write_bytes(b"PK\x03\x04 cut short")  # unreadable: skipped
    assert resolve_ckpt_path(_cfg(d)) == str(d / "step000004-val3.5000.ckpt")
    _save(d / "last.ckpt", 4)
    assert resolve_ckpt_path(_cfg(d)) == str(d / "last.ckpt")


def test_a_kill_between_the_step_file_and_last_ckpt_loses_no_steps_and_leaves_no_duplicate(tiny_cfg, tmp_path):
    common = ["sample.max_new_tokens=0", "trainer.val_check_interval=2", "callbacks.model_checkpoint.save_top_k=-1"]
    # save_top_k=-1: every validation writes a step file, then last.ckpt
    train(tiny_cfg(*common, "trainer.max_steps=2", run="r"))
    run = tmp_path / "r" / "checkpoints"
    if not run.is_dir():
        run = next(tmp_path.glob("**/r/checkpoints"))
    behind = tmp_path / "last_at_2.ckpt"
    shutil.copy(run / "last.ckpt", behind)
    train(tiny_cfg(*common, "trainer.max_steps=4", "resume=auto", run="r"))
    shutil.copy(behind, run / "last.ckpt")  # as if killed after the step-4 file, before last.ckpt
    files = sorted(p.name for p in run.glob("*.ckpt"))
    assert len(files) == 3 and files[2].startswith("step000004"), files
    cfg = tiny_cfg(*common, "trainer.max_steps=6", "resume=auto", run="r")
    assert Path(resolve_ckpt_path(cfg)).name == files[2]
    train(cfg)
    after = sorted(p.name for p in run.glob("*.ckpt"))
    assert not [name for name in after if "-v1" in name], after
    assert torch.load(run / "last.ckpt", weights_only=True)["global_step"] == 6


@pytest.mark.parametrize("kill", ["in_the_first_last_ckpt", "before_last_ckpt"])
def test_the_step_file_resumed_from_leaves_the_top_k_as_a_straight_run_does(tiny_cfg, tmp_path, kill):
    """With the default save_top_k=1, a kill while the first last.ckpt was written (no last.ckpt) or after a step file
    and before last.ckpt (last.ckpt a validation behind) has resume=auto resume from that step file. Lightning never
    removes the file a fit resumed from, so it stayed in the dir for good beside the later best: a fuzzed SIGKILL
    during the first last.ckpt write left step000003-val4.1031.ckpt beside step000012-val3.2713.ckpt."""
    common = ["sample.max_new_tokens=0", "trainer.val_check_interval=2", "scheduler.total_steps=6"]
    straight, _ = train(tiny_cfg(*common, "trainer.max_steps=6", run="straight"))
    run = Path(straight["checkpoint"]).parent
    ckpts = Path(str(run).replace("straight", "r"))
    train(tiny_cfg(*common, "trainer.max_steps=2", run="r"))
    behind = tmp_path / "last_at_2.ckpt"
    shutil.copy(ckpts / "last.ckpt", behind)
    if kill == "before_last_ckpt":
        train(tiny_cfg(*common, "trainer.max_steps=4", "resume=auto", run="r"))
        shutil.copy(behind, ckpts / "last.ckpt")  # as if killed after the step-4 file, before last.ckpt
    else:
        (ckpts / "last.ckpt").unlink()  # as if killed in the rename of the first last.ckpt
    resumed_from = resolve_ckpt_path(tiny_cfg(*common, "trainer.max_steps=6", "resume=auto", run="r"))
    assert Path(resumed_from).name.startswith("step00000"), resumed_from
    resumed, _ = train(tiny_cfg(*common, "trainer.max_steps=6", "resume=auto", run="r"))
    assert resumed["val_loss"] == straight["val_loss"]
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == sorted(p.name for p in run.glob("*.ckpt"))


def test_a_step_file_resumed_from_and_cut_by_a_lower_save_top_k_goes_at_the_first_save(tiny_cfg):
    """save_top_k=2 (mode=max) killed in the step-4 last.ckpt write, resumed with save_top_k=1: the step file resumed
    from, no longer of the top-1, was kept at train start (the only file of its step) and then tracked by nothing, so it
    stayed for good: step000002 and step000004 beside last.ckpt, where a straight save_top_k=1 run keeps step000002."""
    common = ["sample.max_new_tokens=0", "trainer.val_check_interval=2", "scheduler.total_steps=6",
              "callbacks.model_checkpoint.mode=max"]
    straight, _ = train(tiny_cfg(*common, "trainer.max_steps=6", run="straight"))
    run = Path(straight["checkpoint"]).parent
    ckpts = Path(str(run).replace("straight", "r"))
    train(tiny_cfg(*common, "trainer.max_steps=4", "callbacks.model_checkpoint.save_top_k=2", run="r"))
    (ckpts / "last.ckpt").unlink()  # as if killed in the rename of the step-4 last.ckpt
    resumed_from = resolve_ckpt_path(tiny_cfg(*common, "trainer.max_steps=6", "resume=auto", run="r"))
    assert Path(resumed_from).name.startswith("step000004"), resumed_from
    assert len(list(ckpts.glob("step*.ckpt"))) == 2
    train(tiny_cfg(*common, "trainer.max_steps=6", "resume=auto", run="r"))
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == sorted(p.name for p in run.glob("*.ckpt"))


def test_an_unreadable_last_ckpt_is_named_as_unreadable_not_as_older(tmp_path, caplog):
    """A truncated last.ckpt beside a readable step file: the log said the step file 'is newer than' last.ckpt; now it
    names last.ckpt and why it was skipped."""
    d = tmp_path / "checkpoints"
    d.mkdir()
    _save(d / "step000004-val3.5000.ckpt", 4)
    _save(d / "last.ckpt", 4)
    data = (d / "last.ckpt").read_bytes()
    (d / "last.ckpt").write_bytes(data[: len(data) // 2])  # a copy cut short
    with caplog.at_level("WARNING", logger="lit_dtrain.train"):
        assert resolve_ckpt_path(_cfg(d)) == str(d / "step000004-val3.5000.ckpt")
    (line,) = [r.getMessage() for r in caplog.records]
    assert "newer" not in line
    assert line.startswith(f"resume=auto: resuming from {d / 'step000004-val3.5000.ckpt'} (step 4), the newest "
                           f"readable checkpoint: last.ckpt is unreadable, skipped: checkpoint '{d / 'last.ckpt'}' "
                           f"is truncated: its {len(data) // 2} bytes"), line


def test_resume_auto_where_no_checkpoint_can_be_read_says_so(tmp_path):
    """Only unreadable checkpoints: a lone truncated last.ckpt was logged as skipped, then resumed from anyway; a lone
    truncated step file was refused as 'checkpoints of an earlier run; continue it with resume=auto', which was
    given. Now both are refused naming the file and why."""
    for name in ["last.ckpt", "step000004-val3.5000.ckpt"]:
        d = tmp_path / name / "checkpoints"
        d.mkdir(parents=True)
        (d / name).write_bytes(b"PK\x03\x04 cut short")
        expected = rf"^resume=auto: no checkpoint in '{d}' can be resumed \(checkpoint '{d / name}' is truncated: "
        with pytest.raises(ConfigError, match=expected + r".*\); replace or remove it, give ckpt_path"):
            resolve_ckpt_path(_cfg(d))


def test_a_checkpoint_without_optimizer_state_is_refused_in_one_line(tmp_path):
    """A weights-only save (ModelCheckpoint's save_weights_only) given as ckpt_path: Lightning restored it and failed
    with a traceback, "KeyError: 'Trying to restore optimizer state but checkpoint contains only the model ...'"."""
    from lit_dtrain.train import check_optimizer_state

    path = tmp_path / "weights.ckpt"
    torch.save({"global_step": 3, "state_dict": {}, "loops": {}}, path)
    cfg = OmegaConf.create({"optimizer": {"_target_": "lit_dtrain.optim.adamw"}})
    with pytest.raises(ConfigError, match=rf"^checkpoint '{path}' holds no optimizer state \(a weights-only save.*"
                                          rf"cannot be resumed; start a new run_name from its weights with "
                                          rf"init_from={path}$"):
        check_optimizer_state(cfg, str(path))
    torch.save({"global_step": 3, "state_dict": {}, "optimizer_states": [{"state": {}, "param_groups": []}]}, path)
    check_optimizer_state(cfg, str(path))


def test_init_from_with_ckpt_path_names_both():
    """init_from=A ckpt_path=B said only 'set either init_from (...) or ckpt_path (...)', naming neither value."""
    from lit_dtrain.schedules.workflows import check_init_from

    cfg = OmegaConf.create({"init_from": "a.ckpt", "ckpt_path": "b.ckpt"})
    with pytest.raises(ConfigError, match=r"^init_from='a\.ckpt' and ckpt_path='b\.ckpt' are both set: set either "
                                          r"init_from \(weights only"):
        check_init_from(cfg)


def test_a_ckpt_path_from_elsewhere_into_a_run_dir_with_checkpoints_is_refused(tmp_path):
    """ckpt_path=<another run's checkpoint> run_name=<a run with checkpoints of its own> overwrote that run's last.ckpt
    with the other lineage's steps (and left a last-v1.ckpt copy); a run dir without checkpoints still resumes it.
    A roll-back to one of the run's own checkpoints is refused while newer ones are in the run dir (resume=auto
    continued those after an interruption: test_an_interrupted_roll_back_never_resumes_the_abandoned_steps), and
    resumes once they are moved aside."""
    d = tmp_path / "run" / "checkpoints"
    d.mkdir(parents=True)
    _save(d / "last.ckpt", 7)
    _save(d / "step000006-val3.0000.ckpt", 6)
    other = tmp_path / "other.ckpt"
    _save(other, 8)
    cfg = _cfg(d)
    cfg.ckpt_path, cfg.resume = str(other), None
    with pytest.raises(ConfigError, match=r"is not a checkpoint of run dir .*run'.*last.ckpt.*overwrite"):
        resolve_ckpt_path(cfg)
    assert torch.load(d / "last.ckpt")["global_step"] == 7  # untouched
    cfg.ckpt_path = str(d / "step000006-val3.0000.ckpt")  # rolling the run back to its own step file
    with pytest.raises(ConfigError, match=r"^ckpt_path='.*step000006-val3.0000.ckpt' rolls run dir '.*run' back to "
                                          r"step 6, but it holds newer checkpoints \(last.ckpt at step 7\), which "
                                          r"resume=auto would continue \(after an interruption too\) instead of the"
                                          r".* or branch a new run off it in one command, which leaves this one as it "
                                          r"is: run_name=<new name> ckpt_path=.*step000006-val3.0000.ckpt \(add "
                                          r"resume=auto to continue it when requeued\)$"):
        resolve_ckpt_path(cfg)
    (d / "abandoned").mkdir()
    (d / "last.ckpt").rename(d / "abandoned" / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(d / "step000006-val3.0000.ckpt")
    (d / "abandoned" / "last.ckpt").rename(d / "last.ckpt")
    fresh = _cfg(tmp_path / "fresh" / "checkpoints")
    fresh.ckpt_path, fresh.resume = str(other), None
    assert resolve_ckpt_path(fresh) == str(other)


def test_a_requeued_command_with_ckpt_path_and_resume_auto_continues_the_runs_own_checkpoints(tiny_cfg, tmp_path):
    """A requeue-ready command that starts a run from another run's checkpoint (extend a run into a new run dir) and
    keeps resume=auto for its requeues: 'set either resume=auto or ckpt_path=PATH, not both' refused it at its first
    start. Now the first start resumes ckpt_path, and a restart with the same command continues the run's own newest
    checkpoint (ckpt_path no longer read, even when it is gone); the result equals one uninterrupted extension."""
    from lit_dtrain.train import train

    common = ("trainer.val_check_interval=2", "sample.max_new_tokens=0")
    train(tiny_cfg(*common, "trainer.max_steps=4", run="src"))
    source = tmp_path / "src.ckpt"  # outside any run dir, as a pretrained checkpoint
    shutil.copy(tmp_path / "src" / "checkpoints" / "last.ckpt", source)
    command = (*common, "trainer.max_steps=10", f"ckpt_path={source}", "resume=auto")
    fault = ("+callbacks.fault._target_=tests.faults.RaiseOnceAt", "+callbacks.fault.hook=on_after_backward",
             "+callbacks.fault.step=7")
    with pytest.raises(RuntimeError, match="interrupted at step 7"):  # killed after the validation at step 6
        train(tiny_cfg(*command, *fault, run="ext"))
    run = tmp_path / "ext" / "checkpoints"
    assert torch.load(run / "last.ckpt", weights_only=True)["global_step"] == 6
    source.rename(tmp_path / "cleaned_up.ckpt")  # a requeue reads the run's own checkpoints only
    metrics, _ = train(tiny_cfg(*command, run="ext"))
    assert metrics["steps"] == 10
    shutil.move(tmp_path / "cleaned_up.ckpt", source)
    train(tiny_cfg(*common, "trainer.max_steps=10", f"ckpt_path={source}", run="straight"))
    resumed = torch.load(run / "last.ckpt", weights_only=True)["state_dict"]
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_resume_auto_with_ckpt_path_chooses_by_what_the_run_dir_holds(tmp_path):
    """resume=auto with ckpt_path: ckpt_path while the run dir holds no checkpoint (the first start), the run's newest
    afterwards; one of the run's own older checkpoints (a roll-back resume=auto would not do) is refused while newer
    ones are there; the default run_name (a new run dir at every start) is refused as for resume=auto alone."""
    d = tmp_path / "run" / "checkpoints"
    source = tmp_path / "pretrained.ckpt"
    _save(source, 5)
    cfg = _cfg(d)
    cfg.ckpt_path = str(source)
    assert resolve_ckpt_path(cfg) == str(source)
    d.mkdir(parents=True)
    _save(d / "step000006-val3.0000.ckpt", 6)
    _save(d / "last.ckpt", 8)
    assert resolve_ckpt_path(cfg) == str(d / "last.ckpt")
    cfg.ckpt_path = str(d / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(d / "last.ckpt")
    cfg.ckpt_path = str(d / "step000006-val3.0000.ckpt")
    with pytest.raises(ConfigError, match=r"^ckpt_path='.*step000006-val3.0000.ckpt' rolls run dir '.*run' back to "
                                          r"step 6, but it holds newer checkpoints \(last.ckpt at step 8\), which "
                                          r"resume=auto would continue \(after an interruption too\) instead"):
        resolve_ckpt_path(cfg)
    (d / "abandoned").mkdir()
    (d / "last.ckpt").rename(d / "abandoned" / "last.ckpt")  # moved aside: the roll-back is what resume=auto takes
    assert resolve_ckpt_path(cfg) == str(d / "step000006-val3.0000.ckpt")
    from hydra.core.utils import setup_globals

    setup_globals()  # Hydra's ${now:...} resolver, as in train.py
    default = OmegaConf.create({"ckpt_path": str(source), "resume": "auto", "run_name": "${now:%H-%M-%S}",
                                "paths": {"checkpoint_dir": str(tmp_path / "t" / "checkpoints"),
                                          "output_dir": "${run_name}"}})
    with pytest.raises(ConfigError, match=r"^resume=auto needs run_name="):
        resolve_ckpt_path(default)


def test_lightnings_ckpt_path_keywords_point_to_resume_auto(tmp_path, monkeypatch):
    """ckpt_path=last (Lightning's keyword for the newest checkpoint) said only "ckpt_path='last' does not exist"."""
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path / "run" / "checkpoints")
    cfg.ckpt_path, cfg.resume = "last", None
    with pytest.raises(ConfigError, match=r"^ckpt_path='last' does not exist \(Lightning's ckpt_path='last' is not "
                                          r"read here: resume=auto continues the newest checkpoint of run_name's"):
        resolve_ckpt_path(cfg)
    cfg.ckpt_path = "missing.ckpt"
    with pytest.raises(ConfigError, match=r"^ckpt_path='missing.ckpt' does not exist$"):
        resolve_ckpt_path(cfg)


def test_an_interrupted_roll_back_never_resumes_the_abandoned_steps(tiny_cfg, tmp_path):
    """save_top_k=-1, a run to step 6, rolled back to its step-2 file with another LR and killed at step 3 (before its
    first validation): resume=auto resumed last.ckpt, the abandoned step 6, and only validated it (exit 0, the old
    lineage's val_loss). The roll-back is refused while the newer files are there; moved aside, it trains."""
    from lit_dtrain.train import train

    common = ("trainer.val_check_interval=2", "sample.max_new_tokens=0", "callbacks.model_checkpoint.save_top_k=-1",
              "trainer.max_steps=6")
    train(tiny_cfg(*common, run="r"))
    d = tmp_path / "r" / "checkpoints"
    (step2,) = d.glob("step000002-*.ckpt")
    with pytest.raises(ConfigError, match=r"rolls run dir .* back to step 2, but it holds newer checkpoints "
                                          r"\(last.ckpt at step 6, step000006-.* at step 6, step000004-.* at step 4\)"):
        train(tiny_cfg(*common, "optimizer.lr=1e-3", f"ckpt_path={step2}", run="r"))
    (d / "abandoned").mkdir()
    for p in d.glob("*.ckpt"):
        if p != step2:
            p.rename(d / "abandoned" / p.name)
    fault = ("+callbacks.fault._target_=tests.faults.RaiseOnceAt", "+callbacks.fault.hook=on_after_backward",
             "+callbacks.fault.step=3")
    with pytest.raises(RuntimeError, match="interrupted at step 3"):
        train(tiny_cfg(*common, "optimizer.lr=1e-3", f"ckpt_path={step2}", *fault, run="r"))
    cfg = tiny_cfg(*common, "optimizer.lr=1e-3", "resume=auto", run="r")
    assert resolve_ckpt_path(cfg) == str(step2)
    metrics, _ = train(cfg)
    assert metrics["steps"] == 6 and metrics["tokens_per_sec"] is not None  # trained steps 2-5 again


def _loop_state(path, ready: int, steps: int, last_batch: bool = False):
    """A checkpoint whose fit loop is at micro-batch ``ready`` of its epoch after ``steps`` optimizer steps in it,
    as Lightning writes it (``is_last_batch``: saved at the epoch's last batch)."""
    progress = {"current": {"ready": ready, "completed": ready, "started": ready, "processed": ready},
                "is_last_batch": last_batch}
    optim = {"optimizer": {"step": {"current": {"ready": steps, "completed": steps}}}}
    torch.save({"global_step": steps, "state_dict": {}, "loops": {"fit_loop": {
        "epoch_loop.batch_progress": progress, "epoch_loop.automatic_optimization.optim_progress": optim}}}, path)
    return str(path)


def test_a_resume_whose_accumulation_splits_a_step_says_so(tmp_path, caplog):
    """7 steps with accumulate_grad_batches=1, resumed with 2: Lightning steps when its micro-batch count reaches a
    multiple of 2, so the first step after the resume was 1 micro-batch with its loss halved, without a word. The
    warning says why from the epoch's steps in the file: a mid-step file of an earlier lit_dtrain's timed save
    (micro-batch 17 at step 4, 4 per step) was said to have 'changed since it was written'; a file saved at an
    epoch's last batch (16 batches with 3, where Lightning steps anyway and the next epoch counts from 0) was
    warned about at all."""
    from lit_dtrain.resume import warn_if_accumulation_splits

    def warning(path, accumulate):
        caplog.clear()
        cfg = OmegaConf.create({"trainer": {"accumulate_grad_batches": accumulate}})
        with caplog.at_level("WARNING", logger="lit_dtrain.train"):
            warn_if_accumulation_splits(cfg, path)
        return caplog.records[0].getMessage() if caplog.records else None

    seven = _loop_state(tmp_path / "seven.ckpt", 7, 7)
    assert [warning(seven, k) is None for k in (1, 7, 2, 3)] == [True, True, False, False]
    assert warning(seven, 3).endswith(
        "is at micro-batch 7 of its epoch, no multiple of trainer.accumulate_grad_batches=3 (written with "
        "accumulate_grad_batches=1): the first optimizer step after the resume accumulates 2 micro-batch(es), not 3, "
        "and its gradient is 2/3 of a full step's")
    mid_step = _loop_state(tmp_path / "timed.ckpt", 17, 4)
    assert warning(mid_step, 4).endswith(
        "is at micro-batch 17 of its epoch, no multiple of trainer.accumulate_grad_batches=4 (saved mid-step, after "
        "1 of a step's 4 micro-batches, as an earlier lit_dtrain's train_time_interval save or trainer.max_time stop "
        "did): the first optimizer step after the resume accumulates 3 micro-batch(es), not 4, and its gradient is "
        "3/4 of a full step's")
    # 1 step in 5 micro-batches: 3 per step and 2 of the next, or 5 per step; the file cannot tell
    both = warning(_loop_state(tmp_path / "one.ckpt", 5, 1), 3)
    assert "(saved mid-step, after 2 of a step's 3 micro-batches, as an earlier lit_dtrain's train_time_interval " \
           "save or trainer.max_time stop did, or written with accumulate_grad_batches=5)" in both
    assert warning(_loop_state(tmp_path / "end.ckpt", 16, 6, last_batch=True), 3) is None


def test_a_fresh_start_into_a_checkpoint_dir_of_its_own_that_holds_checkpoints_names_that_dir(tmp_path):
    """paths.checkpoint_dir outside the run dir (a scratch disk shared by runs): the refusal named its parent as the
    'run dir' and advised another run_name, which meets the same files again."""
    scratch = tmp_path / "scratch" / "ckpt"
    scratch.mkdir(parents=True)
    _save(scratch / "last.ckpt", 2)
    cfg = OmegaConf.create({"ckpt_path": None, "resume": None, "run_name": "b",
                            "paths": {"checkpoint_dir": str(scratch), "output_dir": str(tmp_path / "runs" / "b")}})
    with pytest.raises(ConfigError, match=rf"^paths.checkpoint_dir '{scratch}' already holds checkpoints of an earlier "
                                          r"run \(last.ckpt\); continue it with resume=auto or ckpt_path=PATH, or give "
                                          "this run another paths.checkpoint_dir$"):
        resolve_ckpt_path(cfg)
    own = tmp_path / "runs" / "a" / "checkpoints"  # the default layout: the run dir is named, as before
    own.mkdir(parents=True)
    _save(own / "last.ckpt", 2)
    with pytest.raises(ConfigError, match=rf"^run dir '{own.parent}' already holds .* or choose another run_name$"):
        resolve_ckpt_path(OmegaConf.merge(_cfg(own), {"resume": None}))


def test_the_resume_choice_is_logged_by_rank_0_alone(tmp_path, caplog, monkeypatch):
    """Every rank of a DDP run resolves the same checkpoint: a 2-rank trainer=ddp_cpu resume printed 'resume=auto:
    resuming from ... step000004-val5.0907.ckpt (step 4), the newest readable checkpoint: there is no last.ckpt' and
    'resume=auto: no .../last.ckpt yet, starting fresh' twice, once per rank. Rank 1 still resolves the same file."""
    from lightning.pytorch.utilities import rank_zero_only

    d = tmp_path / "checkpoints"
    d.mkdir()
    _save(d / "step000004-val3.5000.ckpt", 4)  # killed before last.ckpt
    (d / "step000006-val3.0000.ckpt").write_bytes(b"PK\x03\x04 cut short")
    empty = tmp_path / "fresh" / "checkpoints"
    for rank, lines in ((1, 0), (0, 3)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level("INFO", logger="lit_dtrain.train"):
            assert resolve_ckpt_path(_cfg(d)) == str(d / "step000004-val3.5000.ckpt")
            assert resolve_ckpt_path(_cfg(empty)) is None
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == lines, messages
    assert "skipped as unreadable" in messages[0] and "there is no last.ckpt" in messages[1], messages
    assert "starting fresh" in messages[2], messages
