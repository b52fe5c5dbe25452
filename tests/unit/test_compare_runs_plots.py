"""scripts/compare_runs.py: which runs a directory holds, line styles, colours and legends of the plot."""

from __future__ import annotations

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs, write_run


def test_a_dir_of_several_sweeps_is_not_one_run(tmp_path):
    """`compare_runs.py outputs/multiruns` (the dir that holds every sweep) or `outputs`: the event files of all
    jobs below it were merged into one run named 'multiruns', whose 'final' was whichever job wrote step 30 last
    (6 wsd/cosine jobs tabulated as '| multiruns | 30 | 3.2407 | ...'). Such a dir is expanded into its sweeps'
    jobs and its single runs now."""
    root = tmp_path / "outputs"
    write_run(root / "multiruns" / "t1" / "0", {10: 3.0, 30: 2.5}, overrides=["optimizer.lr=1e-3"])
    write_run(root / "multiruns" / "t1" / "1", {10: 3.1, 30: 2.4}, overrides=["optimizer.lr=3e-3"])
    write_run(root / "multiruns" / "t2" / "0", {10: 3.2, 30: 2.7}, overrides=["optimizer.lr=1e-2"])
    write_run(root / "runs" / "exp1", {10: 3.3, 30: 2.6}, overrides=["optimizer.lr=3e-2"])
    for arg, n in ((root / "multiruns", 3), (root, 4)):
        result = compare_runs.compare([str(arg)], ["val/loss"], out=str(tmp_path / "c.png"))
        finals = {r["label"]: (r["final_step"], r["final"]) for r in result["runs"]}
        assert len(finals) == n, finals
        assert finals["optimizer.lr=1e-3"] == (31, pytest.approx(2.5))
        assert finals["optimizer.lr=3e-3"] == (31, pytest.approx(2.4)) and result["best"] == "optimizer.lr=3e-3"
        assert finals["optimizer.lr=1e-2"] == (31, pytest.approx(2.7))
    # a run with its event files in a subdir of its own (tb/) is still one run
    assert [r["final"] for r in compare_runs.compare([str(root / "runs" / "exp1")], ["val/loss"])["runs"]] == [
        pytest.approx(2.6)]


def test_sweep_jobs_beside_a_single_run_are_labelled_by_real_differences(tmp_path):
    """Sweep jobs and a baseline run made with the same settings: Hydra's sweeper writes the jobs' overrides
    normalized ('trainer.enable_progress_bar=False', 'optimizer.lr=0.001') while a single run keeps them as typed
    ('...=false', '1e-3'), so the labels listed settings that do not differ: 'lr=0.001 enable_progress_bar=False
    enable_model_summary=False progress=False' against 'enable_progress_bar=false ...'. Values are compared as
    values now, and a run that differs only by what it leaves at the default is labelled by its dir name."""
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(["0.001", "0.003"]):
        write_run(sweep / str(i), {20: 3.4 - i * 0.2},
                  overrides=[f"optimizer.lr={lr}", "trainer.max_steps=20", "trainer.enable_progress_bar=False"])
    base = write_run(tmp_path / "runs" / "base", {20: 3.2},
                     overrides=["run_name=base", "trainer.max_steps=20", "trainer.enable_progress_bar=false"])
    other = write_run(tmp_path / "runs" / "other", {20: 3.3},
                      overrides=["optimizer.lr=1e-3", "trainer.max_steps=20", "trainer.enable_progress_bar=false",
                                 "seed=7"])
    result = compare_runs.compare([str(sweep), str(base), str(other)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=0.001", "optimizer.lr=0.003", "base",
                                                    "optimizer.lr=0.001 seed=7"]  # 1e-3 as the jobs write it
    plain = write_run(tmp_path / "runs" / "plain", {20: 3.2})  # `python train.py`: Hydra writes '[]'
    (plain / ".hydra").mkdir()
    (plain / ".hydra" / "overrides.yaml").write_text("[]\n")
    result = compare_runs.compare([str(sweep), str(plain)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == [
        "lr=0.001 max_steps=20 enable_progress_bar=false", "lr=0.003 max_steps=20 enable_progress_bar=false", "plain"]


def test_every_run_of_a_large_sweep_has_its_own_line_style(tmp_path, monkeypatch):
    """A 2 x 6 sweep (scheduler x optimizer.lr) has 12 runs; matplotlib's colour cycle has 10, so runs 0 and 10,
    1 and 11 were drawn in the same colour, marker and line style: two legend entries for one look."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.extend(
        (line.get_label(), line.get_color(), line.get_linestyle()) for line in fig.axes[0].lines))
    curves = {f"run{i}": {"val/loss": [(1, 3.0 + i), (2, 2.0 + i)]} for i in range(25)}
    compare_runs.plot(curves, ["val/loss"], tmp_path / "c.png")
    assert [label for label, _, _ in seen] == list(curves)
    assert len({(color, style) for _, color, style in seen}) == 25


def test_a_run_missing_from_one_panel_keeps_its_colour_in_the_others(tmp_path, monkeypatch):
    """The legend is drawn in the first panel only, but each panel took colours in turn from the runs that had its
    metric: with run 'a' lacking comm/bytes_per_step (it died before logging it), run 'b' was drawn in a's colour
    there, so the second panel named the wrong runs."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        {line.get_label(): line.get_color() for line in fig.axes[1].lines} | {
            "first": {line.get_label(): line.get_color() for line in fig.axes[0].lines}}))
    curves = {"a": {"val/loss": [(1, 3.0)], "comm/b": []},
              "b": {"val/loss": [(1, 2.0)], "comm/b": [(1, 5.0)]}}
    compare_runs.plot(curves, ["val/loss", "comm/b"], tmp_path / "c.png")
    assert seen[0]["b"] == seen[0]["first"]["b"] != seen[0]["first"]["a"]


def test_the_legend_names_runs_drawn_only_in_a_later_panel(tmp_path, monkeypatch):
    """A run without the first metric (killed before its first validation) but with the second was drawn in the
    second panel and missing from the legend, which is built from the first panel's lines only."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [t.get_text() for t in fig.axes[0].get_legend().get_texts()]))
    curves = {"a": {"val/loss": [(1, 3.0)], "train/loss": [(1, 4.0)]}, "b": {"val/loss": [], "train/loss": [(1, 5.0)]}}
    compare_runs.plot(curves, ["val/loss", "train/loss"], tmp_path / "c.png")
    assert seen == [["a", "b"]]


def test_a_metric_no_run_has_lists_the_tags_of_all_runs(tmp_path):
    """A typo in --metric named the first run's tags only: with a failed job first (an event file without scalars,
    NonFiniteError at step 1) it said "run '.../1' has no scalar 'val/los'; it has []", hiding the right name."""
    empty = tmp_path / "1"
    SummaryWriter(str(empty / "tb")).close()
    ok = write_run(tmp_path / "0", {5: 3.0})
    with pytest.raises(compare_runs.CompareError,
                       match=r"no scalar 'val/los' in any of the 2 runs; they have \['lr-AdamW/decay', 'val/loss'\]"):
        compare_runs.compare([str(empty), str(ok)], ["val/los"])


def test_runs_with_the_same_label_are_all_plotted(tmp_path, monkeypatch):
    """Two sweeps copied from two machines, /m1/sweep/0 and /m2/sweep/0 with the same overrides, both got the label
    'sweep/0'; the plot keeps its curves in a dict by label, so one run's curve replaced the other's (2 table rows,
    1 line). Labels are made unique now: by as many parent dirs as tell them apart ('m1/sweep/0', 'm2/sweep/0'),
    and numbered where nothing does (--labels x,x: 'x', 'x (2)')."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [(line.get_label(), line.get_ydata()[-1]) for line in fig.axes[0].lines]))
    a = write_run(tmp_path / "m1" / "sweep" / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    b = write_run(tmp_path / "m2" / "sweep" / "0", {5: 2.0}, overrides=["optimizer.lr=1e-3"])
    result = compare_runs.compare([str(a), str(b)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == ["m1/sweep/0", "m2/sweep/0"]
    assert seen[-1] == [("m1/sweep/0", pytest.approx(3.0)), ("m2/sweep/0", pytest.approx(2.0))]
    result = compare_runs.compare([str(a), str(b)], ["val/loss"], labels=["x", "x"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == ["x", "x (2)"] and len(seen[-1]) == 2


def test_only_files_given_says_so(tmp_path):
    """`compare_runs.py outputs/runs/a/checkpoints/last.ckpt` skipped the file (a shell glob over a sweep dir also
    matches multirun.yaml) and then failed with "no scalar 'val/loss' in any of the 0 runs; they have []"."""
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    match = r"no run dir among the arguments: .*last.ckpt' is a file; give the run dir that holds it \(e.g. outputs/"
    with pytest.raises(compare_runs.CompareError, match=match):
        compare_runs.compare([str(ckpt)], ["val/loss"])
