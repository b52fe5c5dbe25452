"""A checkpoint path key given empty (``init_from=$CKPT`` with ``CKPT`` unset) is refused, not read as not given."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_dtrain.errors import ConfigError
from lit_dtrain.schedules._init_from import refuse_empty_checkpoint_paths
from tests.conftest import compose_cfg


@pytest.mark.parametrize("overrides, key", [
    (["experiment=cpt_replay", "init_from=''"], "init_from"),
    (["init_from=' '"], "init_from"),
    (["decay_branch.ckpt=''", "decay_branch.steps=4"], "decay_branch.ckpt"),
    # ckpt_path=$CKPT with CKPT unset: a fresh run at step 0, no word (also beside resume=auto, on its first start)
    (["ckpt_path=''"], "ckpt_path"), (["ckpt_path=''", "resume=auto", "run_name=r"], "ckpt_path"),
])
def test_an_empty_checkpoint_path_is_refused(tmp_path, overrides, key):
    """`experiment=cpt_replay init_from=` trained its continual pre-training from random weights at step 0
    (check_init_from read the empty string as no init_from), and
    `decay_branch.ckpt=` was refused as `decay_branch.ckpt='' is a directory`; `ckpt_path=` started a fresh run."""
    with pytest.raises(ConfigError, match=rf"^{key} is empty \({key}='\s*'; an unset shell variable\?\): give a "
                                          rf"checkpoint file, or {key}=null for none$"):
        refuse_empty_checkpoint_paths(compose_cfg(overrides, tmp_path / "r", tiny=False))


@pytest.mark.parametrize("overrides", [
    [],
    ["experiment=cpt_replay"],  # its required init_from, not given: its own error follows
    ["init_from=x.ckpt", "ckpt_path=y.ckpt"],  # other checks judge the files
])
def test_checkpoint_paths_not_given_or_required_are_not_refused(tmp_path, overrides):
    refuse_empty_checkpoint_paths(compose_cfg(overrides, tmp_path / "r", tiny=False))


def test_train_refuses_an_empty_init_from_before_any_step(tiny_cfg):
    """The refusal is wired into train(): `init_from=''` trained from random weights at step 0 before it."""
    from lit_dtrain.train import train

    cfg = tiny_cfg("trainer.max_steps=2", "init_from=''")
    with pytest.raises(ConfigError, match=r"^init_from is empty"):
        train(cfg)
    assert not list(Path(cfg.paths.output_dir).rglob("*.ckpt"))
