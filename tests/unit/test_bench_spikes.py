"""The benchmark scripts write their figures under their own output dir unless a path is given."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("_bench_spikes_plot", ROOT / "scripts" / "bench_spikes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("plot_arg, where", [(None, "out"), ("elsewhere.png", "given"), ("", None)])
def test_the_figure_goes_under_out_dir_by_default_never_to_the_docs(tmp_path, monkeypatch, plot_arg, where):
    """A smoke run with the defaults overwrote docs/img/spikes_loss.png; only an explicit --plot may write there."""
    mod = load_script()
    written = []
    monkeypatch.setattr(mod, "plot", lambda results, schedule, path: written.append(path))
    monkeypatch.setattr(mod, "run_variant", lambda args, name, *_: {  # no training: the plotting path only
        "val_loss": 2.0, "ours_steps": [], "lightning_steps": [], "max_loss_z": 0.5, "max_loss_rel": 0.1})
    argv = ["bench_spikes.py", "--variants", "clean", "--out-dir", str(tmp_path / "out")]
    if plot_arg is not None:
        argv += ["--plot", str(tmp_path / plot_arg) if plot_arg else ""]
    monkeypatch.setattr(sys, "argv", argv)
    mod.main()
    expected = {"out": [tmp_path / "out" / "spikes_loss.png"], "given": [tmp_path / "elsewhere.png"], None: []}
    assert written == expected[where]
    assert (tmp_path / "out" / "results.json").is_file()


@pytest.mark.parametrize("script, keys", [("bench_wsd", ["img_dir", "out_dir"]), ("bench_comm", ["out"]),
                                          ("bench_activation_ckpt", ["plot"])])
def test_the_other_benchmarks_write_no_figure_into_the_docs_unless_asked(script, keys, monkeypatch, tmp_path):
    """Like bench_spikes: a smoke run with the defaults (``bench_wsd.py --quick``: "numbers meaningless") must not
    overwrite the docs' figures; the documented commands name docs/img explicitly."""
    spec = importlib.util.spec_from_file_location(f"_{script}_defaults", ROOT / "scripts" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)  # parse_args makes the default --out dir (outputs/bench_comm) under the cwd
    args = mod.parse_args([])
    docs = (ROOT / "docs").resolve()
    for key in keys:
        value = getattr(args, key)
        assert value is None or docs not in (ROOT / value).resolve().parents and (ROOT / value).resolve() != docs


def test_a_diverged_runs_ratio_is_null_in_the_json_line(tmp_path, monkeypatch, capsys):
    """The unprotected run diverges (val loss NaN): its val loss was null in the last JSON line, with
    ``unprotected_diverged``, but its ratio to the clean run the string ``"nan"`` where the other ratios are numbers."""
    import json

    mod = load_script()
    monkeypatch.setattr(mod, "plot", lambda *_: None)
    monkeypatch.setattr(mod, "run_variant", lambda args, name, *_: {
        "val_loss": float("nan") if name == "unprotected" else 2.2 if name == "skip" else 2.0, "ours_steps": [],
        "lightning_steps": [], "max_loss_z": 0.5, "max_loss_rel": 0.1, "halted_at": None})
    argv = ["bench_spikes.py", "--variants", "clean,unprotected,skip", "--out-dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    mod.main()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["val_loss_unprotected"] is None and summary["unprotected_diverged"] is True
    assert summary["ratio_unprotected_vs_clean"] is None
    assert summary["ratio_skip_vs_clean"] == pytest.approx(1.1)


@pytest.mark.parametrize("clean_loss, skip_cell", [(2.0, "1.1000"), (float("nan"), "-")])
def test_the_ratios_are_printed_as_a_table_and_a_diverged_clean_run_gives_none(tmp_path, monkeypatch, capsys,
                                                                             clean_loss, skip_cell):
    """The ratios to the clean run were in the last JSON line only (a benchmark prints its ratios); and a clean run
    that diverged made every ratio NaN, which is no JSON."""
    import json

    mod = load_script()
    monkeypatch.setattr(mod, "plot", lambda *_: None)
    monkeypatch.setattr(mod, "run_variant", lambda args, name, *_: {
        "val_loss": clean_loss if name == "clean" else 2.2, "ours_steps": [], "lightning_steps": [],
        "max_loss_z": 0.5, "max_loss_rel": 0.1, "halted_at": None})
    argv = ["bench_spikes.py", "--variants", "clean,skip", "--out-dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    mod.main()
    lines = capsys.readouterr().out.strip().splitlines()
    json.loads(lines[-1], parse_constant=lambda c: pytest.fail(f"{c} in the JSON line"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[-4:-1]}
    assert rows["variant"] == ["val", "loss", "vs", "clean"]
    assert rows["skip"] == ["2.2000", skip_cell]


@pytest.mark.parametrize("flag, value, message", [("--plot", "fig.txt", "matplotlib cannot write '.txt' files"),
                                                   ("--out-dir", "a_file", "is a file; give a directory"),
                                                   ("--out-dir", "a_file/sub", "cannot create its directory: Not a")])
def test_the_output_paths_are_checked_before_any_run(tmp_path, monkeypatch, capsys, flag, value, message):
    """A ``--plot`` matplotlib cannot write failed in savefig after every run (a ValueError traceback), and an
    ``--out-dir`` that is a file, or below one (a_file/sub, which the first check let by), failed at the first run
    (NotADirectoryError); each is one line before any run."""
    import json

    mod = load_script()
    ran = []
    monkeypatch.setattr(mod, "run_variant", lambda args, name, *_: ran.append(name) or {
        "val_loss": 2.0, "ours_steps": [], "lightning_steps": [], "max_loss_z": 0.5, "max_loss_rel": 0.1})
    (tmp_path / "a_file").write_text("")
    argv = ["bench_spikes.py", "--variants", "clean", "--out-dir", str(tmp_path / "out"), flag, str(tmp_path / value)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        mod.main()
    assert exit_info.value.code == 2 and ran == []
    assert message in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]


def test_the_lr_x100_spike_is_one_step_long_beside_another_step_post_hook():
    """SpikeInjector removed its LR-restoring hook inside torch's loop over the step post hooks: with a hook
    registered after it, the step raised 'OrderedDict mutated during iteration'."""
    import torch

    injector = load_script().SpikeInjector({0: "lr_x100"})
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    trainer = type("T", (), {"global_step": 0, "callbacks": []})()
    lrs_seen = []
    injector.on_before_optimizer_step(trainer, None, opt)
    opt.register_step_post_hook(lambda o, *a: lrs_seen.append(o.param_groups[0]["lr"]))
    p.grad = torch.ones(2)
    opt.step()
    assert lrs_seen == [0.1]  # restored by the injector's hook, which ran first
    assert p.detach().tolist() == pytest.approx([1 - 10.0, 1 - 10.0])  # the step itself ran at 100x
    injector.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    trainer.global_step = 1
    injector.on_before_optimizer_step(trainer, None, opt)
    opt.step()
    assert opt.param_groups[0]["lr"] == 0.1 and lrs_seen == [0.1, 0.1]


def test_the_lr_x100_spike_is_put_back_where_its_step_was_skipped():
    import torch

    injector = load_script().SpikeInjector({0: "lr_x100"})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    trainer = type("T", (), {"global_step": 0, "callbacks": []})()
    injector.on_before_optimizer_step(trainer, None, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(10.0)
    injector.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)  # no opt.step(): skipped
    assert opt.param_groups[0]["lr"] == 0.1
