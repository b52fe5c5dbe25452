"""A key the config lacks, set on the command line (``python train.py optimizer.lrr=1e-3``): one line naming it and
the closest key (``lit_dtrain._compose_errors``). Hydra printed 'Could not override ...', 'To append to your config
use +optimizer.lrr=1e-3' and OmegaConf's 'Key 'lrr' is not in struct' over five lines, suggesting nothing. Hydra's
other errors are reported by Hydra as before. ``main`` here composes as ``@hydra.main`` does, in-process."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

from lit_dtrain._compose_errors import composed, run_reporting_unknown_keys
from tests.conftest import CONF_DIR


def composing(*overrides: str):
    def main():
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            compose(config_name="train", overrides=list(overrides))
        composed()  # as train.py's task function does first
    return main


@pytest.fixture(autouse=True)
def no_full_error(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)


@pytest.mark.parametrize(("override", "line"), [
    ("optimizer.lrr=1e-3", "optimizer.lrr is not a config key; did you mean 'optimizer.lr'?"),
    ("trainer.max_step=5", "trainer.max_step is not a config key; did you mean 'trainer.max_steps'?"),
    ("sed=3", "sed is not a config key; did you mean 'seed'?"),
    ("scheduler.zzz=3", "scheduler.zzz is not a config key (scheduler holds _partial_, _target_, decay_fraction, "
                        "decay_steps, decay_type, min_lr_factor, total_steps, warmup_steps)"),
    # an argument of the node's target that the config does not set: '+' adds it (the line named the node's keys)
    ("trainer.detect_anomaly=true", "trainer.detect_anomaly is not in the config but is an argument of "
                                    "lightning.pytorch.Trainer: add it with '+', '+trainer.detect_anomaly=true'"),
    # a Trainer argument train.py passes itself: its '+' form, which the line above advised, was silently ignored
    ("trainer.strategy=ddp", "trainer.strategy is passed to the Trainer by train.py, so a value here would be "
                             "ignored: choose it with 'strategy=<option of conf/strategy>' (or 'strategy.name="
                             "<Lightning's name>' under strategy=auto)"),
    ("callbacks.model_checkpoint.every_n_train_step=4", "callbacks.model_checkpoint.every_n_train_step is not a "
     "config key; did you mean '+callbacks.model_checkpoint.every_n_train_steps=4'? (lit_dtrain.callbacks."
     "ModelCheckpoint takes every_n_train_steps, which the config does not set: '+' adds it)"),
    ("trainer.max_time.hours=1", "trainer.max_time.hours is not a config key (trainer.max_time holds no keys: add "
                                 "one with '+', '+trainer.max_time.hours=1')"),  # (it named '' as the keys held)
    ("callbacks.loss_spike.z=3", "callbacks.loss_spike is not a config key (callbacks holds lr_monitor, "
     "memory, model_checkpoint, preemption, progress_bar, throughput; one of conf/callbacks is chosen first, "
     "'callbacks=[default,loss_spike]')"),  # a callback not chosen: its keys only named the chosen ones
    # no such option: it advised 'callbacks=[default,early_stop]' and 'callbacks=[default,grad_clip]', which Hydra
    # then refused ("Could not find 'callbacks/early_stop'")
    ("callbacks.early_stop.patience=3", "callbacks.early_stop is not a config key (callbacks holds lr_monitor, "
     "memory, model_checkpoint, preemption, progress_bar, throughput; conf/callbacks has no option 'early_stop' (its "
     "options: adaptive_grad_clip, fourier_sampler, loss_spike, optimizer_diagnostics, selective_ckpt, wsd); a "
     "callback of one's own is added with '+callbacks.early_stop._target_=<its class>')"),
    ("callbacks.grad_clip.x=1", "callbacks.grad_clip is not a config key (callbacks holds lr_monitor, "
     "memory, model_checkpoint, preemption, progress_bar, throughput; conf/callbacks has no option 'grad_clip' "
     "(did you mean adaptive_grad_clip?); a callback of one's own is added with "
     "'+callbacks.grad_clip._target_=<its class>')"),
])
def test_an_unknown_key_is_one_line_naming_the_closest(override, line, capsys):
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", override), config_dir=CONF_DIR)
    assert stop.value.code == 1
    assert capsys.readouterr().err == f"error: {line}\n"
    assert "HYDRA_FULL_ERROR" not in os.environ



def test_a_source_field_its_config_does_not_set_is_added_with_a_plus(capsys):
    """data=mixture's source 0 is the stdlib, without paths: made a files source, its paths were refused as
    '(data.sources.0 holds kind, name, weight)', naming no fix; a source has no _target_, so its fields are
    CorpusSource's."""
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", "data=mixture", "data.sources.0.kind=files",
                                             "data.sources.0.paths=[/corpus]"), config_dir=CONF_DIR)
    assert stop.value.code == 1
    assert capsys.readouterr().err == ("error: data.sources.0.paths is not in the config but is an argument of "
                                       "lit_dtrain.data.CorpusSource: add it with '+', "
                                       "'+data.sources.0.paths=[/corpus]'\n")

def test_other_composition_errors_are_hydras_own_and_a_good_start_runs(capsys, monkeypatch):
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nanoo"))
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Could not find 'model/nanoo'" in err and not err.startswith("error: ")
    seen = []
    run_reporting_unknown_keys(lambda: seen.append(os.environ.get("HYDRA_FULL_ERROR")))
    assert seen == ["1"] and "HYDRA_FULL_ERROR" not in os.environ  # set while Hydra composes only
    run_reporting_unknown_keys(composing("optimizer.lr=1e-3"))
    assert "HYDRA_FULL_ERROR" not in os.environ
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the user's own switch: Hydra's full error, untouched
    with pytest.raises(Exception, match="Could not override 'optimizer.lrr'"):
        run_reporting_unknown_keys(composing("optimizer.lrr=1e-3"))
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_the_hydra_callbacks_refuse_in_one_line_while_hydra_composes(capsys):
    """While Hydra composes, ``HYDRA_FULL_ERROR=1`` is this module's, not the user's: the Hydra callbacks' refusals
    (``_exit_with``) read it as the user's and raised, which Hydra only logs for a callback, so ``run_name=''`` trained
    into the runs dir itself."""
    from omegaconf import OmegaConf

    from lit_dtrain.sweeps import OutputDirCheck

    config = OmegaConf.create({"run_name": "", "hydra": {"run": {"dir": "/tmp/unused"}}})
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(lambda: OutputDirCheck().on_run_start(config))
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: run_name='' names no run dir of its own") and err.count("\n") == 1


def test_a_whole_traceback_is_printed_as_before_without_this_modules_frames(capsys):
    """An error that is not a composition error, raised before the task function (``--cfg job --resolve`` of an
    unresolvable value, ``-m ... --cfg job``), printed with its traceback: re-raised into Hydra's ``run_and_report``,
    that traceback gained this module's frames (84 lines where Hydra's were 68; 16 for Python's 8)."""
    from hydra._internal.utils import run_and_report

    def boom():
        raise KeyError("COMP_LINE")

    def main():
        run_and_report(boom)  # where Hydra reports what fails before the task function (it prints all of this one)

    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(main)
    ours = capsys.readouterr().err
    with pytest.raises(SystemExit):
        main()  # without HYDRA_FULL_ERROR=1 (the fixture): Hydra's own report
    assert stop.value.code == 1 and ours == capsys.readouterr().err and "_compose_errors" not in ours

    def outside():  # raised outside Hydra's report (_run_hydra's "Only one of --run, --multirun, ..."): Python's
        raise ValueError("Only one of --run, --multirun")

    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(outside)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.endswith("ValueError: Only one of --run, --multirun\n")
    assert "_compose_errors" not in err and "in outside" in err


def test_a_key_added_with_plus_to_a_callback_not_chosen_names_the_choice():
    """'+callbacks.loss_spike.z=3' without loss_spike among the callbacks said 'callbacks.loss_spike has no _target_':
    '+' added a node holding z alone. It names the choice as the form without '+' does, inside the Hydra app (its
    config loader lists the options): an option that does not exist is not advised ('+callbacks.early_stop.patience=3'
    said "'callbacks=[default,early_stop]'"); outside one, no option is named."""
    from omegaconf import OmegaConf

    from lit_dtrain.train import ConfigError, build_callbacks

    def refusal(name: str, key: str) -> str:
        with pytest.raises(ConfigError) as refused:
            build_callbacks(OmegaConf.create({"callbacks": {name: {key: 3}}}))
        return str(refused.value)

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):  # as in train.py's task function
        assert refusal("loss_spike", "z") == ("callbacks.loss_spike has no _target_ (it holds only z); one of "
                                              "conf/callbacks is chosen first, 'callbacks=[default,loss_spike]'")
        assert refusal("early_stop", "patience") == (
            "callbacks.early_stop has no _target_ (it holds only patience); conf/callbacks has no option 'early_stop' "
            "(its options: adaptive_grad_clip, fourier_sampler, loss_spike, optimizer_diagnostics, selective_ckpt, "
            "wsd); a callback of one's own is added with '+callbacks.early_stop._target_=<its class>'")
    assert refusal("early_stop", "patience") == (
        "callbacks.early_stop has no _target_ (it holds only patience); a conf/callbacks option is chosen first "
        "('callbacks=[default,<option>]'), or callbacks.early_stop given a _target_")


@pytest.mark.parametrize(("override", "form"), [
    ("callbacks=[default,wsd]", "'callbacks=[default,wsd]'"),
    # a WSDScheduler added with '+' is no conf/callbacks option: it advised 'callbacks=[default,my_wsd]'
    ("+callbacks.my_wsd._target_=lit_dtrain.callbacks.WSDScheduler", "beside callbacks.my_wsd"),
])
def test_the_wsd_callback_beside_a_scheduler_is_told_an_option_only_where_it_is_one(override, form):
    from lit_dtrain.config_checks import check_config
    from lit_dtrain.errors import ConfigError

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):  # as in train.py's task function
        cfg = compose(config_name="train", overrides=["model=nano", override])
        with pytest.raises(ConfigError) as refused:
            check_config(cfg)
    assert str(refused.value).endswith(f"configures an LR scheduler too; use one of them: '~scheduler' {form} for "
                                       "the callback form")


@pytest.mark.parametrize(("override", "fix"), [
    ("optimizer=null", "(options: adamw, adamw8bit); choose an option instead (optimizer=adamw)"),  # as '~optimizer'
    ("model=1", "(options: llama_125m, nano, small); choose an option instead (model=nano)"),
    ("paths=null", "(options: default); choose one (paths=default)"),
    ("scheduler=null", "(options: constant, cosine, wsd); choose one, or leave the group out with '~scheduler'"),
    ("logger=null", "(options: csv, none, tensorboard); choose one ('logger=none' for none)"),
    ("data/sampler=null", "(options: fourier, random); choose one"),
    # it said "or leave the group out with '~hydra'": that run had Hydra's own dirs (./outputs/<date>/<time>, not
    # LIT_DTRAIN_OUTPUT's runs/) and none of conf/hydra/default.yaml's launch checks
    ("hydra=null", "(options: default); choose one (hydra=default)"),
    # a list holding null: Hydra's traceback ending in "TypeError: argument of type 'NoneType' is not iterable"
    ("callbacks=[default,null]", "(options: adaptive_grad_clip, default, fourier_sampler, loss_spike, none, "
                                 "optimizer_diagnostics, selective_ckpt, wsd); choose one ('callbacks=none' for none)"),
])
def test_a_config_group_given_no_option_name_is_one_line_naming_its_options(override, fix, capsys, monkeypatch):
    """`python train.py optimizer=null` printed Hydra's 25-line traceback ending in 'ValueError: Config group override
    must be a string or a list. Got NoneType', naming neither the group nor a fix (every group alike: scheduler,
    model, data, strategy, logger, callbacks, trainer, paths, experiment)."""
    monkeypatch.setattr("sys.argv", ["train.py", "model=nano", override])
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", override), config_dir=CONF_DIR)
    assert stop.value.code == 1
    group, _, value = override.partition("=")
    value = "null" if "null" in value else value
    assert capsys.readouterr().err == (f"error: {override}: config group '{group}' takes the name of one of its "
                                       f"options, not {value} {fix}\n")


def test_a_callbacks_option_of_a_searchpath_dir_is_not_called_missing(tmp_path):
    """An option in a ``hydra.searchpath`` dir (``callbacks=[default,mycb]`` composes) was told "conf/callbacks has
    no option 'mycb'" and left out of the options listed: the '+' form's line (in the task function) now lists the
    searchpath's options too, and the line when composing failed (train.py's conf dir is all it can read) names none."""
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "mycb.yaml").write_text(
        "mycb:\n  _target_: lightning.pytorch.callbacks.EarlyStopping\n  monitor: val/loss\n")

    def last_line(override: str) -> str:
        proc = subprocess.run([sys.executable, "train.py", f"hydra.searchpath=[file://{tmp_path}]", override,
                               "trainer.max_steps=1"], cwd=ROOT, env=subprocess_env(tmp_path), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 1, proc.stderr[-2000:]
        return proc.stderr.strip().splitlines()[-1]

    assert last_line("+callbacks.mycb.patience=3") == (
        "error: callbacks.mycb has no _target_ (it holds only patience); one of conf/callbacks is chosen first, "
        "'callbacks=[default,mycb]'")
    assert last_line("callbacks.mycb.patience=3") == (
        "error: callbacks.mycb is not a config key (callbacks holds lr_monitor, memory, model_checkpoint, "
        "preemption, progress_bar, throughput; a conf/callbacks option is chosen first "
        "('callbacks=[default,<option>]'), or callbacks.mycb given a _target_)")


def test_a_searchpath_callbacks_option_whose_node_is_named_otherwise_is_named_as_the_option(tmp_path):
    """``callbacks/early.yaml`` holding ``early_stopping:``: '+callbacks.early_stopping.patience=5' was told
    "conf/callbacks has no option 'early_stopping' (its options: ..., early, ...)". The line names the option that
    adds the node, and the command it gives trains with the setting."""
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "early.yaml").write_text(
        "early_stopping:\n  _target_: lightning.pytorch.callbacks.EarlyStopping\n  monitor: val/loss\n  patience: 3\n")
    (tmp_path / "callbacks" / "a_global.yaml").write_text(  # its node is not put in callbacks: not the one
        "# @package _global_\nearly_stopping: {}\n")

    def run(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "train.py", f"hydra.searchpath=[file://{tmp_path}]", *overrides,
                               "trainer.max_steps=1", "sample.max_new_tokens=0", "run_name=early"], cwd=ROOT,
                              env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)

    proc = run("+callbacks.early_stopping.patience=5")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: callbacks.early_stopping has no _target_ (it holds only patience); the callbacks option 'early' "
        f"({tmp_path / 'callbacks' / 'early.yaml'}) adds it, chosen first: 'callbacks=[default,early]'")
    fixed = run("callbacks=[default,early]", "callbacks.early_stopping.patience=5")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    from omegaconf import OmegaConf

    resolved = OmegaConf.load(tmp_path / "outputs" / "runs" / "early" / "config_resolved.yaml")
    assert resolved.callbacks.early_stopping.patience == 5


@pytest.mark.parametrize("text, package", [
    ("# @package _global_\n# an experiment\nx: 1\n", "_global_"),
    ("\n# @package callbacks\nx: 1\n", "callbacks"),
    ("# an early stop of my own\n# @package _global_\nx: 1\n", None),  # below a plain comment: Hydra reads no header
    ("x: 1\n# @package _global_\n", None),
    ("# @package _global_\r\n\r\nx: 1\r\n", "_global_"),  # as Hydra, from the text read in universal newlines
    ("\n" * 600 + "# @package _global_\nx: 1\n", None),  # past the 512 characters Hydra reads: no header to Hydra
])
def test_a_config_files_package_is_read_from_hydras_header_alone(tmp_path, text, package):
    """'# @package _global_' below a plain comment was read as the file's package, where Hydra stops its header at
    the first line that is no '# @...' line and puts the node in its group: callbacks/early.yaml of a searchpath dir
    so written (its node early_stopping, which 'callbacks=[default,early]' adds) was skipped, and
    '+callbacks.early_stopping.patience=5' was told "conf/callbacks has no option 'early_stopping'"."""
    from hydra.plugins.config_source import ConfigSource

    from lit_dtrain._compose_errors import read_config_file

    (tmp_path / "c.yaml").write_bytes(text.encode())
    with open(tmp_path / "c.yaml", encoding="utf-8") as f:  # as Hydra's FileConfigSource reads it
        hydras = ConfigSource._get_header_dict(f.read(512))["package"]
    assert read_config_file(tmp_path / "c.yaml")[1] == package == hydras


def test_deleting_a_list_item_is_one_line_naming_the_override_and_the_fix(capsys, monkeypatch):
    """``'~data.sources.1'`` (to drop ``data=mixture``'s second source) failed inside Hydra 1.3 with 'TypeError: list
    indices must be integers or slices, not str' in a 25-line traceback (hydra#2477)."""
    monkeypatch.setattr("sys.argv", ["train.py", "data=mixture", "~data.sources.1"])
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing("model=nano", "data=mixture", "~data.sources.1"), config_dir=CONF_DIR)
    assert stop.value.code == 1
    assert capsys.readouterr().err == ("error: '~data.sources.1': Hydra cannot delete an item of a list (it takes the "
                                       "index 1 for a key; hydra#2477): set the list whole without it instead, "
                                       "'data.sources=[...]'\n")


def test_deleting_a_list_item_names_that_override_not_a_digit_key_of_a_dict_deleted_beside_it(capsys, monkeypatch):
    """``+foo.1=a '~foo.1' '~data.sources.1'``: Hydra deletes the dict's key '1' and fails at the list's item; the
    line named '~foo.1' (the first '~<key>.<digits>' on the command line) and told to set 'foo=[...]'."""
    args = ["model=nano", "data=mixture", "+foo.1=a", "~foo.1", "~data.sources.1"]
    monkeypatch.setattr("sys.argv", ["train.py", *args])
    with pytest.raises(SystemExit) as stop:
        run_reporting_unknown_keys(composing(*args), config_dir=CONF_DIR)
    assert stop.value.code == 1
    assert capsys.readouterr().err.startswith("error: '~data.sources.1': Hydra cannot delete an item of a list")
