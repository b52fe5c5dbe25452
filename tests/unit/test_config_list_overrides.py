"""An override that passes through a list by a key that is no index of it (``data.sources.name=x``: the sources are
a list, set by index) or by an index past its end (``data=mixture data.sources.5.name=x``): one line naming the
override and the fix (``lit_dtrain._compose_errors.list_key_message``). OmegaConf raised "ValueError: invalid literal
for int() with base 10: 'name'" in Hydra's 25-line traceback, or Hydra printed 'Error merging override' and 'list
index out of range', neither naming a fix."""

from __future__ import annotations

import pytest

from lit_dtrain._compose_errors import run_reporting_unknown_keys
from tests.conftest import CONF_DIR
from tests.unit.test_config_unknown_keys import composing


@pytest.fixture(autouse=True)
def no_full_error(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)


@pytest.mark.parametrize(("overrides", "line"), [
    (["data.sources.name=x"], "'data.sources.name=x': data.sources is a list of 1 item, whose items are set by "
                              "index ('data.sources.0.name=x'), or the list whole ('data.sources=[...]')"),
    (["data=mixture", "data.sources.weight=2"],
     "'data.sources.weight=2': data.sources is a list of 2 items (indices 0 to 1), whose items are set by index "
     "('data.sources.0.weight=2'), or the list whole ('data.sources=[...]')"),
    (["data.sources.name.x=1"], "'data.sources.name.x=1': data.sources is a list of 1 item, whose items are set by "
                                "index ('data.sources.0.name.x=1'), or the list whole ('data.sources=[...]')"),
    (["++data.sources.name=x"], "'++data.sources.name=x': data.sources is a list of 1 item, whose items are set by "
                                "index ('++data.sources.0.name=x'), or the list whole ('data.sources=[...]')"),
    (["~data.sources.name"], "'~data.sources.name': data.sources is a list of 1 item, whose items are set by index "
                             "('~data.sources.0.name'), or the list whole ('data.sources=[...]')"),
    # a list of values: the key stood for an index; an item itself cannot be deleted (hydra#2477)
    (["optimizer.betas.x=0.9"], "'optimizer.betas.x=0.9': optimizer.betas is a list of 2 items (indices 0 to 1), "
                                "whose items are set by index ('optimizer.betas.0=0.9'), or the list whole "
                                "('optimizer.betas=[...]')"),
    (["~optimizer.betas.x"], "'~optimizer.betas.x': optimizer.betas is a list of 2 items (indices 0 to 1); set the "
                             "list whole ('optimizer.betas=[...]') without the item instead"),
    (["data=mixture", "data.sources.5.name=x"],
     "'data.sources.5.name=x': data.sources is a list of 2 items (indices 0 to 1), with no item 5 to set; to add "
     "one, set the list whole ('data.sources=[...]')"),
    # an empty list has no index to suggest: 'data.sources.0.paths.0=/tmp', suggested, failed in its turn
    (["data=textfiles", "data.sources.0.paths.x=/tmp"],
     "'data.sources.0.paths.x=/tmp': data.sources.0.paths is an empty list, with no item to set; set the list whole "
     "('data.sources.0.paths=[...]')"),
    (["data=textfiles", "data.sources.0.paths.0=/tmp"],
     "'data.sources.0.paths.0=/tmp': data.sources.0.paths is an empty list, with no item to set; set the list whole "
     "('data.sources.0.paths=[...]')"),
])
def test_a_key_or_index_a_list_lacks_is_one_line_naming_the_override_and_the_fix(overrides, line, capsys):
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", *overrides), config_dir=CONF_DIR)
    assert stop.value.code == 1
    assert capsys.readouterr().err == f"error: {line}\n"


def test_an_index_of_a_list_still_sets_its_item():
    """The line is for a failed override only: an index within the list composes as before."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=mixture", "data.sources.1.name=prose"])
    assert [s.name for s in cfg.data.sources] == ["stdlib", "prose"]


@pytest.mark.parametrize(("override", "line"), [
    ("callbacks=[default,loss_spik]", "'callbacks=[default,loss_spik]': config group 'callbacks' has no option "
                                      "'loss_spik' (did you mean loss_spike? options: adaptive_grad_clip, default, "
                                      "fourier_sampler, loss_spike, none, optimizer_diagnostics, selective_ckpt, wsd)"),
    ("callbacks=[default,zzzz]", "'callbacks=[default,zzzz]': config group 'callbacks' has no option 'zzzz' "
                                 "(options: adaptive_grad_clip, default, fourier_sampler, loss_spike, none, "
                                 "optimizer_diagnostics, selective_ckpt, wsd)"),
])
def test_an_option_a_groups_list_lacks_is_one_line_naming_the_options(override, line, capsys, monkeypatch):
    """Hydra printed "In 'train': Could not load 'callbacks/loss_spik'." and its config search path: 6 lines naming
    no option (its 'Could not find' of one option, 'model=nanoo', lists them)."""
    monkeypatch.setattr("sys.argv", ["train.py", "model=nano", override])
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", override), config_dir=CONF_DIR)
    assert stop.value.code == 1
    assert capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize(("override", "line"), [
    ("data.sources.0.namex=x", "data.sources.0.namex is not a config key; did you mean 'data.sources.0.name'?"),
    ("data.sources.0.zzzz=x", "data.sources.0.zzzz is not a config key (data.sources.0 holds kind, name, weight)"),
])
def test_a_key_an_item_of_a_list_lacks_is_named_as_an_override_writes_it(override, line, capsys):
    """The line named OmegaConf's 'data.sources[0].namex' and advised 'data.sources[0].name', which the override
    grammar refuses (LexerNoViableAltException)."""
    with pytest.raises(SystemExit):
        run_reporting_unknown_keys(composing("model=nano", override), config_dir=CONF_DIR)
    assert capsys.readouterr().err == f"error: {line}\n"


def test_hydras_own_report_where_its_override_loop_is_not_found(capsys, monkeypatch):
    """The list and the override are read from the frame of Hydra's override loop (hydra 1.3 private). Where another
    Hydra has no such frame, the error is Hydra's own report, as before these lines, not a crash in lit_dtrain's."""
    monkeypatch.setattr("lit_dtrain.utils.hydra_overrides._override_loop_locals", lambda error: {})
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", "data.sources.name=x"), config_dir=CONF_DIR)
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "invalid literal for int() with base 10: 'name'" in err and "whose items are set by index" not in err


@pytest.mark.parametrize(("overrides", "line"), [
    (["data.sources.-1.weight=2"], "'data.sources.-1.weight=2': Hydra's override grammar has no negative list index "
                                   "(-1): data.sources holds 1 item, so give 'data.sources.0.weight=2'"),
    (["data=mixture", "data.sources.-1.weight=2"],
     "'data.sources.-1.weight=2': Hydra's override grammar has no negative list index (-1): data.sources holds 2 "
     "items, so give 'data.sources.1.weight=2'"),
    (["data=mixture", "data.sources.-3.weight=2"],
     "'data.sources.-3.weight=2': Hydra's override grammar has no negative list index (-3), and data.sources holds 2 "
     "items, none 3 from the end; set the list whole ('data.sources=[...]')"),
    (["data=mixture", "~data.sources.-1"],
     "'~data.sources.-1': Hydra's override grammar has no negative list index (-1), and cannot delete a list item at "
     "all (hydra#2477): set the list whole without it, 'data.sources=[...]'"),
    # a sweep composes no one config here: how to count instead
    (["seed=1,2", "data.sources.-1.weight=2"],
     "'data.sources.-1.weight=2': Hydra's override grammar has no negative list index (-1): give the item's index "
     "counted from 0 ('data.sources.<index>.weight=2'; '--cfg job' shows the list)"),
])
def test_a_negative_list_index_is_one_line_with_the_index_from_0(overrides, line, capsys, monkeypatch):
    """Hydra's lexer printed 'LexerNoViableAltException: data.sources.-1.weight=2', a caret and a link: 3 lines naming
    neither the cause nor the form the grammar takes."""
    monkeypatch.setattr("sys.argv", ["train.py", "model=nano", *overrides])
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", *overrides), config_dir=CONF_DIR)
    assert stop.value.code == 1
    assert capsys.readouterr().err == f"error: {line}\n"
    from hydra import compose, initialize_config_dir  # the form given composes

    if "give 'data.sources." in line:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            given = line.rpartition("give '")[2].rstrip("'")
            assert compose(config_name="train", overrides=[*overrides[:-1], given]).data.sources[-1].weight == 2
