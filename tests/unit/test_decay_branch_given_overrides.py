"""``decay_branch`` compares the keys it sets with the command line's (``trainer.max_steps=20 decay_branch.steps=4``
is refused): the command line was read resolved as a whole list, so a valid relative interpolation in any override
(``'data.val_batch_size=${.batch_size}'``, relative to ``data``) failed the branch with 'Index 'batch_size' (str) is
not an int' in a traceback."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lit_dtrain.schedules._branch_overrides import RELATIVE, Interpolation, _given_overrides
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
    # is the value it gives, with the key it names; a deletion is left out
    assert given == {"data.val_batch_size": RELATIVE, "trainer.max_steps": Interpolation("data.batch_size", 8)}


def test_only_a_key_the_branch_sets_is_read_in_the_config():
    """Every relative override was resolved in the config: 'sample.top_k=${.nope}' (no key the branch sets) failed
    decay_branch with a 20-line InterpolationKeyError traceback, where the same command without the branch is one
    line, 'error: Interpolation key 'nope' not found'. Only a key the branch sets is read now; one that cannot be
    resolved is refused as typed."""
    import pytest

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.schedules._branch_overrides import refuse_given_branch_keys

    for bad, refused in (("sample.top_k=${.nope}", None), ("scheduler.decay_steps=${.nope}", "${.nope}"),
                         ("scheduler.decay_steps=${.warmup_steps}", "1")):
        overrides = ["scheduler.warmup_steps=1", bad]
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            full = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        with open_dict(full):
            full.hydra.overrides.task = overrides
        with in_hydra_job(full) as cfg:
            if refused is None:
                refuse_given_branch_keys(cfg, [("scheduler", cfg.scheduler)], 2, 3)
                continue
            with pytest.raises(ConfigError) as e:
                refuse_given_branch_keys(cfg, [("scheduler", cfg.scheduler)], 2, 3)
        assert str(e.value) == (f"decay_branch sets scheduler.decay_steps=3 (decay_branch.steps), but "
                                f"scheduler.decay_steps={refused} is given; drop scheduler.decay_steps (decay_branch."
                                "steps is the decay's length)")


def test_a_key_the_branch_sets_given_in_a_mapping_is_judged():
    """'++scheduler={decay_steps:5}' and '++trainer={max_steps:20}' set keys the branch sets, read only as the
    mapping of 'scheduler' and 'trainer': a 3-step branch replaced them without a word (it stopped at step 5, exit 0).
    A mapping's keys are judged as the same keys typed alone are."""
    for typed, refused in (("++scheduler={decay_steps:5}", "scheduler.decay_steps=5"),
                           ("++trainer={max_steps:20}", "trainer.max_steps=20"),
                           ("++scheduler={warmup_steps:1,decay_steps:3}", None)):  # the branch's own value
        _judged(typed, refused)


def test_a_value_naming_a_key_the_branch_sets_is_judged_with_the_branchs_value():
    """'scheduler.total_steps=${trainer.max_steps}' (the WSD config's own value) was refused as 'scheduler.total_steps=
    1000 is given', trainer.max_steps before the branch set it to 6; the run it refused trains as the branch alone does.
    A value naming another key the branch sets is that key's branch value, so one that differs is still refused."""
    for typed, refused in (("scheduler.total_steps=${trainer.max_steps}", None),
                           ("scheduler.decay_steps=${trainer.max_steps}", "scheduler.decay_steps=5"),
                           ("scheduler.total_steps=${data.batch_size}", "scheduler.total_steps=8")):
        _judged(typed, refused)


def test_an_interpolation_in_a_mapping_is_judged_by_the_value_it_gives(monkeypatch):
    """'++scheduler={decay_steps:${oc.env:STEPS}}' with STEPS=3, the branch's own decay_steps, was refused as
    'scheduler.decay_steps=${oc.env:STEPS} is given' (the text compared, not its value; typed alone it trains); a
    relative one ('${.warmup_steps}') is read in the config, as typed alone."""
    monkeypatch.setenv("STEPS", "3")
    for typed, refused in (("++scheduler={decay_steps:${oc.env:STEPS}}", None),
                           ("++scheduler={warmup_steps:3,decay_steps:${.warmup_steps}}", None),
                           ("++scheduler={warmup_steps:1,decay_steps:${.warmup_steps}}", "scheduler.decay_steps=1"),
                           ("++trainer={max_steps:${oc.env:STEPS}}", "trainer.max_steps=3")):
        _judged(typed, refused)


def _judged(typed: str, refused: str | None) -> None:
    """The branch's check (2 + 3 steps) on a config composed with ``typed``: passes (``refused`` None), or refuses
    naming ``refused`` ('key=value')."""
    import pytest

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.schedules._branch_overrides import refuse_given_branch_keys

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        full = compose(config_name="train", overrides=[typed], return_hydra_config=True)
    with open_dict(full):
        full.hydra.overrides.task = [typed]
    with in_hydra_job(full) as cfg:
        if refused is None:
            refuse_given_branch_keys(cfg, [("scheduler", cfg.scheduler)], 2, 3)
            return
        with pytest.raises(ConfigError, match=f"but {refused} is given; drop {refused.split('=')[0]} "):
            refuse_given_branch_keys(cfg, [("scheduler", cfg.scheduler)], 2, 3)
