"""A decay branch or an extension of a continual-pre-training run, typed with its ``experiment=cpt_replay``: the
experiment's required ``init_from`` is not needed when a checkpoint is resumed in full."""

from __future__ import annotations

import pytest

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.config_resolvers import RequiredValueError
from lit_dtrain.schedules._init_from import drop_required_init_from_on_a_full_resume
from lit_dtrain.train import ConfigError, train
from tests.conftest import compose_cfg


@pytest.mark.parametrize("key", ["decay_branch.ckpt", "ckpt_path"])
def test_a_full_resume_of_a_cpt_run_needs_no_init_from(tmp_path, key):
    """Before, ``experiment=cpt_replay decay_branch.ckpt=... decay_branch.steps=4`` stopped at ``give init_from=PATH``,
    and with ``init_from`` given at ``set either decay_branch.ckpt or init_from, not both``: no command branched a
    CPT run's stable checkpoint. Now the checkpoint itself is read (a file that is no checkpoint here)."""
    ckpt = tmp_path / "step8.ckpt"
    ckpt.write_bytes(b"not a checkpoint")
    given = [f"{key}={ckpt}"] + (["decay_branch.steps=4"] if key == "decay_branch.ckpt" else [])
    cfg = compose_cfg(["experiment=cpt_replay", *given, "sample.max_new_tokens=0"], tmp_path / "r", tiny=False)
    drop_required_init_from_on_a_full_resume(cfg)
    assert cfg.init_from is None
    cfg = compose_cfg(["experiment=cpt_replay", *given, "sample.max_new_tokens=0"], tmp_path / "s", tiny=False)
    with pytest.raises((ConfigError, CheckpointError), match=r"step8.ckpt") as e:
        train(cfg)
    assert "init_from" not in str(e.value)


def test_a_fresh_cpt_start_still_needs_init_from(tmp_path):
    cfg = compose_cfg(["experiment=cpt_replay", "sample.max_new_tokens=0"], tmp_path / "r", tiny=False)
    drop_required_init_from_on_a_full_resume(cfg)
    with pytest.raises(ConfigError, match=r"experiment=cpt_replay.*init_from=PATH"):
        train(cfg)
    given = compose_cfg(["experiment=cpt_replay", "init_from=/x/last.ckpt", "decay_branch.ckpt=/x/s.ckpt",
                         "decay_branch.steps=2"], tmp_path / "g", tiny=False)
    drop_required_init_from_on_a_full_resume(given)
    assert given.init_from == "/x/last.ckpt"  # given: kept, and refused with the branch as before


def test_a_cpt_run_extended_with_resume_auto_needs_no_init_from(tmp_path):
    """``experiment=cpt_replay run_name=B resume=auto trainer.max_steps=6`` in run B's dir (checkpoints at step 4)
    stopped at 'give init_from=PATH', which resume=auto would not read. A fresh start with resume=auto (no checkpoint
    yet) still needs it."""
    args = ["experiment=cpt_replay", "resume=auto", "sample.max_new_tokens=0"]
    fresh = compose_cfg(args, tmp_path / "r", tiny=False)
    drop_required_init_from_on_a_full_resume(fresh)
    with pytest.raises(RequiredValueError, match=r"experiment=cpt_replay.*init_from=PATH"):
        fresh.get("init_from")
    cfg = compose_cfg(args, tmp_path / "r", tiny=False)
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "last.ckpt").write_bytes(b"the run's own")
    drop_required_init_from_on_a_full_resume(cfg)
    assert cfg.init_from is None


def test_a_full_resume_records_where_the_checkpoints_run_began(tmp_path):
    """``run_name=c1 init_from=<base>`` then ``run_name=c1 resume=auto trainer.max_steps=4`` (init_from left out,
    as it is not read): c1's config_resolved.yaml said ``init_from: null``, and compare_runs.py labelled it
    ``init_from=null`` beside a run trained alike from <base> (the same val/loss, 4.5933). A full resume without
    init_from records the checkpoint's run's now, read before this start rewrites that file; a given one, and a
    checkpoint without a run's config beside it, are left as they are."""
    from lit_dtrain.schedules._init_from import keep_the_weights_origin

    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"the run's own")
    (run / "config_resolved.yaml").write_text("init_from: /x/base.ckpt\nrun_name: c1\n")
    cfg = compose_cfg(["resume=auto"], run, tiny=False)
    assert cfg.init_from is None
    keep_the_weights_origin(cfg, run / "checkpoints" / "last.ckpt")
    assert cfg.init_from == "/x/base.ckpt"
    given = compose_cfg(["init_from=/y/other.ckpt"], tmp_path / "g", tiny=False)
    keep_the_weights_origin(given, run / "checkpoints" / "last.ckpt")
    assert given.init_from == "/y/other.ckpt"
    bare = tmp_path / "b" / "x" / "step4.ckpt"  # no config_resolved.yaml two levels up
    bare.parent.mkdir(parents=True)
    fresh = compose_cfg(["resume=auto"], tmp_path / "f", tiny=False)
    keep_the_weights_origin(fresh, bare)
    assert fresh.init_from is None
