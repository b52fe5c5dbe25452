"""``decay_branch`` compares the keys it sets with the command line's (``trainer.max_steps=20 decay_branch.steps=4``
is refused): the command line was read resolved as a whole list, so a valid relative interpolation in any override
(``'data.val_batch_size=${.batch_size}'``, relative to ``data``) failed the branch with 'Index 'batch_size' (str) is
not an int' in a traceback."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lit_dtrain.schedules.workflows import RELATIVE, _given_overrides
from tests.conftest import CONF_DIR, in_hydra_job


def test_the_given_overrides_read_a_relative_interpolation_and_resolve_the_others():
    overrides = ["data.val_batch_size=${.batch_size}", "trainer.max_steps=${data.batch_size}", "~sample"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        full = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    with open_dict(full):
        full.hydra.overrides.task = overrides
    with in_hydra_job(full):
        given = _given_overrides()
    # the relative one is marked for the config to resolve (decay_branch reads it there); an interpolation elsewhere
    # is the value it gives; a deletion is left out
    assert given == {"data.val_batch_size": RELATIVE, "trainer.max_steps": 8}
