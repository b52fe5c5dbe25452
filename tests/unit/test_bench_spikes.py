"""scripts/bench_spikes.py writes its figure under its own --out-dir unless a path is given."""

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
