"""What a resume is refused before fit: a checkpoint past max_steps, `resume=auto` without a run name or in a new
multirun dir, a directory for a checkpoint, the other AdamW."""

from datetime import datetime
from pathlib import Path

import pytest
import torch

from lit_dtrain.config_checks import check_config
from lit_dtrain.train import ConfigError
from tests.conftest import compose_cfg


def test_a_checkpoint_past_max_steps_is_refused(tiny_cfg, tmp_path):
    """ckpt_path/resume=auto of a run at step 9 with trainer.max_steps=3 trained nothing, exited 0, reported
    steps=9 and logged 'the checkpoint is already at step 9 = trainer.max_steps'. At max_steps it stays the
    documented validate-only resume of a finished run."""
    from lit_dtrain.train import check_start_step

    cfg = tiny_cfg("trainer.max_steps=3")
    with pytest.raises(ConfigError, match=r"is at step 9, past trainer.max_steps=3; .*trainer.max_steps >= 9"):
        check_start_step(cfg, 9, "run/checkpoints/last.ckpt")
    check_start_step(cfg, 3, "run/checkpoints/last.ckpt")  # a finished run: validated only
    check_start_step(cfg, 0, None)


def test_resume_auto_without_a_run_name_is_refused(tmp_path, corpus):
    """`python train.py resume=auto` (no run_name) resolved run_name to a new timestamp, so it never found the run
    to continue and silently started a fresh one in a new dir; an explicit run_name without checkpoints still
    starts fresh (README: 'picks up last.ckpt of that run dir, if any')."""
    from omegaconf import open_dict

    from lit_dtrain.train import resolve_ckpt_path

    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "runs" / str(cfg.run_name))  # as conf/hydra puts a single run
        cfg.paths.checkpoint_dir = str(tmp_path / "runs" / str(cfg.run_name) / "checkpoints")
    with pytest.raises(ConfigError, match=r"resume=auto needs run_name=<the run to continue>"):
        resolve_ckpt_path(cfg)
    named = compose_cfg(["resume=auto", "run_name=exp1"], tmp_path / "x", corpus)
    with open_dict(named):
        named.paths.output_dir = str(tmp_path / "runs" / "exp1")
        named.paths.checkpoint_dir = str(tmp_path / "runs" / "exp1" / "checkpoints")
    assert resolve_ckpt_path(named) is None  # a fresh start of the named run
    # a run_name given on the command line that looks like the default timestamp (continuing a default-named run
    # killed before its first checkpoint) is a name like any other: it was refused as if no run_name were given
    stamp = "2026-12-03_19-45-00"
    given = compose_cfg(["resume=auto", f"run_name={stamp}"], tmp_path / "x", corpus)
    with open_dict(given):
        given.paths.output_dir = str(tmp_path / "runs" / stamp)
        given.paths.checkpoint_dir = str(tmp_path / "runs" / stamp / "checkpoints")
    assert resolve_ckpt_path(given) is None


def test_a_checkpoint_key_naming_a_directory_says_so(tiny_cfg, tmp_path):
    """ckpt_path=<run>/checkpoints (the dir, not the file) was reported as 'does not exist'."""
    from lit_dtrain.schedules.workflows import apply_decay_branch, check_init_from
    from lit_dtrain.train import resolve_ckpt_path

    d = tmp_path / "somerun" / "checkpoints"
    d.mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"ckpt_path='{d}' is a directory, not a checkpoint file; it holds none"):
        resolve_ckpt_path(tiny_cfg(f"ckpt_path={d}"))
    with pytest.raises(ConfigError, match=rf"init_from='{d}' is a directory, not a checkpoint file; it holds none"):
        check_init_from(tiny_cfg(f"init_from={d}"))
    with pytest.raises(ConfigError, match=rf"decay_branch.ckpt='{d}' is a directory, not a checkpoint file; it holds"):
        apply_decay_branch(tiny_cfg(f"decay_branch.ckpt={d}", "decay_branch.steps=2"))



def test_a_directory_named_last_ckpt_in_the_run_dir_is_refused_before_training(tiny_cfg):
    """A directory `checkpoints/last.ckpt` beside a step checkpoint: resume=auto passed it over as unreadable, resumed
    the step file, trained, and failed at its first save ('could not write checkpoint .../last.ckpt: Is a directory;
    the previous file at that path is intact'); a fresh start was told to resume=auto. Both are refused before any
    training now, naming the directory."""
    from lit_dtrain.train import resolve_ckpt_path

    for overrides in (["resume=auto", "run_name=exp1"], []):
        cfg = tiny_cfg(*overrides)
        last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
        last.mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": 2}, last.parent / "step000002.ckpt")
        with pytest.raises(ConfigError, match=rf"^'{last}' is a directory: every run saves its last checkpoint at "
                                              "that path, so this one would train and fail at its first save"):
            resolve_ckpt_path(cfg)

def test_adamw8bit_where_bitsandbytes_does_not_import_is_one_config_error(tiny_cfg, monkeypatch):
    """optimizer=adamw8bit without a working bitsandbytes was an ImportError with Hydra's traceback, from check_config's
    build of the optimizer on a dummy parameter; now one ConfigError line that names the cause and the way out."""
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # 'import bitsandbytes' raises ModuleNotFoundError
    with pytest.raises(ConfigError, match=r"^optimizer: optimizer=adamw8bit needs bitsandbytes, which does not import "
                                          r"here \(ModuleNotFoundError: .*\): pip install bitsandbytes, or use "
                                          r"optimizer=adamw$"):
        check_config(tiny_cfg("optimizer=adamw8bit"))


@pytest.mark.parametrize("saved, configured", [("torch", "adamw8bit"), ("bnb", "adamw")])
def test_resuming_with_the_other_adamw_is_refused_before_fit(saved, configured, tiny_cfg, tmp_path):
    """ckpt_path=<an AdamW run> optimizer=adamw8bit restored the checkpoint and died at the first step with
    KeyError: 'state1' inside bitsandbytes; the other way round with KeyError: 'exp_avg' inside torch.optim."""
    from lit_dtrain.train import check_optimizer_state

    t = torch.zeros(2)
    state = {"step": torch.tensor(3.0), "exp_avg": t, "exp_avg_sq": t} if saved == "torch" else \
        {"step": 3, "__bnb_optimizer_quant_state__": {}}
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 3, "state_dict": {}, "optimizer_states": [{"state": {0: state}, "param_groups": []}]},
               ckpt)
    with pytest.raises(ConfigError, match=rf"checkpoint '{ckpt}' holds .* optimizer state, but optimizer={configured}"
                                          r" is configured; .*init_from="):
        check_optimizer_state(tiny_cfg(f"optimizer={configured}"), str(ckpt))
    check_optimizer_state(tiny_cfg(f"optimizer={'adamw' if saved == 'torch' else 'adamw8bit'}"), str(ckpt))


def test_resume_auto_in_a_new_multirun_dir_is_refused(tmp_path, corpus):
    """Re-running a killed sweep as `python train.py -m ... resume=auto` wrote a new timestamped sweep dir, so every
    job logged 'no .../last.ckpt yet, starting fresh' and retrained from step 0 (reproduced: job 1 killed at step
    26 with last.ckpt; the re-run trained it 0..60 in a second sweep dir). With hydra.sweep.dir=<the old sweep dir>
    each job resumes its own <dir>/<job num>, and that stays allowed."""
    from omegaconf import open_dict

    from lit_dtrain.train import resolve_ckpt_path

    def job_cfg(sweep_dir: Path, num: int, *extra: str):
        cfg = compose_cfg(["resume=auto", *extra], tmp_path / "x", corpus)
        with open_dict(cfg):  # as conf/hydra/default.yaml lays out a multirun job
            cfg.paths.output_dir = str(sweep_dir / str(num))
            cfg.paths.checkpoint_dir = str(sweep_dir / str(num) / "checkpoints")
        return cfg

    cfg = job_cfg(tmp_path / "multiruns" / "x", 1)
    fresh = tmp_path / "multiruns" / f"{cfg.run_name}.123456"  # ${now:%Y-%m-%d_%H-%M-%S.%f} of this start
    with pytest.raises(ConfigError, match=r"resume=auto in a multirun needs hydra\.sweep\.dir=<the sweep to "
                                          rf"continue>: .*'{fresh}' .*job N resumes <sweep dir>/N"):
        resolve_ckpt_path(job_cfg(fresh, 1))
    # run_name names nothing in a multirun: `-m ... run_name=exp1 resume=auto` also started every job fresh
    now = tmp_path / "multiruns" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")
    with pytest.raises(ConfigError, match=r"resume=auto in a multirun needs hydra\.sweep\.dir="):
        resolve_ckpt_path(job_cfg(now, 0, "run_name=exp1"))
    old = tmp_path / "multiruns" / "2020-01-02_03-04-05.678901"  # an earlier sweep, pinned with hydra.sweep.dir
    assert resolve_ckpt_path(job_cfg(old, 1)) is None  # that job had not started: a fresh start of it
    (old / "1" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 2, "state_dict": {}}, old / "1" / "checkpoints" / "last.ckpt")  # a readable one
    assert resolve_ckpt_path(job_cfg(old, 1)) == str(old / "1" / "checkpoints" / "last.ckpt")
