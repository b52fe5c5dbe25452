"""scripts/compare_runs.py --over KEY: runs that differ only in KEY (a seed sweep) as one group, mean ± std."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.unit._compare_runs_helpers import compare_runs, write_run


def seed_sweep(sweep, finals):
    """Jobs of ``-m optimizer.lr=1e-3,3e-3 seed=0,1,2``: ``finals[lr][seed]`` is the job's last val/loss; a job whose
    value is None has no summary.json (it did not finish)."""
    n = 0
    for lr, by_seed in finals.items():
        for seed, final in enumerate(by_seed):
            job = write_run(sweep / str(n), {4: 4.0, 9: final if final is not None else 3.9},
                            overrides=["trainer.max_steps=10", f"optimizer.lr={lr}", f"seed={seed}"])
            (job / "config_resolved.yaml").write_text(f"seed: {seed}\noptimizer:\n  lr: {float(lr)}\n")
            if final is not None:
                (job / "summary.json").write_text(json.dumps({"steps": 10}))
            n += 1


def test_runs_differing_only_in_the_seed_are_one_group_with_mean_and_std(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    seed_sweep(sweep, {"1e-3": [3.0, 3.2, 3.1], "3e-3": [2.9, 3.5, None]})
    out = tmp_path / "g.png"
    assert compare_runs.main([str(sweep), "--over", "seed", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    groups = {g["label"]: g for g in result["groups"]}
    assert list(groups) == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    low = groups["optimizer.lr=1e-3"]["by_metric"]["val/loss"]
    assert low["n"] == 3 and low["left_out"] == 0
    assert low["final_mean"] == pytest.approx(3.1)
    assert low["final_std"] == pytest.approx(statistics.stdev([3, 3.2, 3.1]))
    high = groups["optimizer.lr=3e-3"]["by_metric"]["val/loss"]  # the unfinished seed 2 is left out, and counted
    assert high["n"] == 2 and high["left_out"] == 1 and high["final_mean"] == pytest.approx(3.2)
    assert groups["optimizer.lr=3e-3"]["runs"] == ["optimizer.lr=3e-3 seed=0", "optimizer.lr=3e-3 seed=1",
                                                    "optimizer.lr=3e-3 seed=2"]
    # the best single run is lr=3e-3's seed 0 (2.9); the best mean is lr=1e-3's (3.1 < 3.2)
    assert result["best"] == "optimizer.lr=3e-3 seed=0"
    assert result["best_group_by_metric"]["val/loss"] == "optimizer.lr=1e-3"
    assert "| optimizer.lr=1e-3 | 3 | 3.1000 ± 0.1000 | 3.1000 ± 0.1000 | +0.00% |" in printed
    assert ("| optimizer.lr=3e-3 | 2 (+1 failed, unfinished or not started) | 3.2000 ± 0.4243 | 3.2000 ± 0.4243 | "
            "+3.23% |") in printed
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_the_group_curves_are_the_mean_of_the_finished_runs_with_their_std(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    seed_sweep(sweep, {"1e-3": [3.0, 3.2], "3e-3": [2.9, None]})
    drawn = []
    monkeypatch.setattr(compare_runs, "plot", lambda curves, *a, spread=None, **k: drawn.append((curves, spread)))
    compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "g.png"), over=["seed"])
    curves, spread = drawn[0]
    assert curves["optimizer.lr=1e-3"]["val/loss"] == [(5, pytest.approx(4.0)), (10, pytest.approx(3.1))]
    assert spread["optimizer.lr=1e-3"]["val/loss"] == [0.0, pytest.approx(statistics.stdev([3.0, 3.2]))]
    assert curves["optimizer.lr=3e-3"]["val/loss"] == [(5, 4.0), (10, pytest.approx(2.9))]  # seed 1 is unfinished


def test_a_pure_seed_sweep_is_one_group_and_a_key_no_run_sets_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    for seed, final in enumerate([3.0, 3.4]):
        write_run(sweep / str(seed), {9: final}, overrides=["trainer.max_steps=10", f"seed={seed}"])
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "g.png"), over=["seed"])
    assert [g["label"] for g in result["groups"]] == ["(all runs)"]
    assert result["groups"][0]["by_metric"]["val/loss"]["final_mean"] == pytest.approx(3.2)
    with pytest.raises(compare_runs.CompareError, match=r"--over sede: no run sets 'sede'.*'seed'"):
        compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "g.png"), over=["sede"])


def test_a_key_every_run_set_to_one_value_is_refused_where_it_grouped_each_run_alone(tmp_path, capsys):
    """'-m seed=0,1 optimizer.lr=1e-3,3e-3 trainer.max_steps=8' compared --over trainer.max_steps: every job typed it,
    all with 8, so no two runs differ in it alone; it printed a 'mean ± std over trainer.max_steps' table of four
    groups of n = 1, each its run's own value. --over seed in the same sweep still groups."""
    sweep = tmp_path / "sweep"
    seed_sweep(sweep, {"1e-3": [3.0, 3.2], "3e-3": [2.9, 3.5]})
    args = [str(sweep), "--out", str(tmp_path / "g.png")]
    assert compare_runs.main(args + ["--over", "trainer.max_steps"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["compare_runs: error: --over trainer.max_steps: every run trained with the same "
                    "'trainer.max_steps', so it groups no runs; give a key whose value differs between the runs "
                    "(they differ in ['optimizer.lr', 'seed'])"]
    with pytest.raises(compare_runs.CompareError, match=r"--over trainer.max_steps: every run trained with the same"):
        compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "g.png"),
                             over=["seed", "trainer.max_steps"])
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "g.png"), over=["seed"])
    assert [(g["label"], g["by_metric"]["val/loss"]["n"]) for g in result["groups"]] == [
        ("optimizer.lr=1e-3", 2), ("optimizer.lr=3e-3", 2)]


def test_jobs_that_logged_nothing_count_in_their_group_and_a_setting_that_only_failed_has_a_row(tmp_path):
    """A killed '-m seed=0,1' (job 1 never started) beside a run of another dropout: job 1 has no config, so its
    label lacks the dropout job 0 trained with ('model.dropout=0.0', from its config_resolved.yaml); it counts in job
    0's group, not in a group of its own. A sweep whose one job failed before logging (a bad value) is a row with
    n = 0."""
    sweep = tmp_path / "killed"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "  overrides:\n    task:\n    - seed=0,1\n")
    job0 = write_run(sweep / "0", {9: 3.0}, overrides=["seed=0"])
    other = write_run(tmp_path / "other" / "0", {9: 3.3}, overrides=["model.dropout=0.1", "seed=0"])
    for run, dropout in ((job0, 0.0), (other, 0.1)):
        (run / "config_resolved.yaml").write_text(f"seed: 0\nmodel:\n  dropout: {dropout}\n")
        (run / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices: {}\n")
        (run / "summary.json").write_text(json.dumps({"steps": 10}))
    bad = tmp_path / "bad" / "0" / ".hydra"  # Hydra wrote its config, the job failed before logging
    bad.mkdir(parents=True)
    (bad / "overrides.yaml").write_text("- model.dropout=1.5\n- seed=0\n")
    result = compare_runs.compare([str(sweep), str(tmp_path / "other"), str(tmp_path / "bad")], ["val/loss"],
                                  out=str(tmp_path / "g.png"), over=["seed"])
    assert result["markdown"].split("\n\n")[1].splitlines()[2:] == [
        "| model.dropout=0.0 | 1 (+1 failed, unfinished or not started) | 3.0000 | 3.0000 | +0.00% |",
        "| model.dropout=0.1 | 1 | 3.3000 | 3.3000 | +10.00% |",
        "| model.dropout=1.5 | 0 (+1 failed, unfinished or not started) | - | - | - |",
    ]


def test_a_diverged_groups_gap_is_in_exponent_form_as_the_runs_table(tmp_path, capsys):
    """The per-run table prints a gap from 1e6 % in exponent form; the ``--over`` table printed a diverged group's
    (mean val/loss 5e29 against 30.5) as a 31-digit percentage, '+1639344286963059446062189117440.00%'."""
    sweep = tmp_path / "sweep"
    seed_sweep(sweep, {"1e-3": [30.0, 31.0], "1e-1": [4.9e29, 5.1e29]})
    assert compare_runs.main([str(sweep), "--over", "seed"]) == 0
    printed = capsys.readouterr().out
    assert "| optimizer.lr=1e-1 | 2 | 5.000e+29 ± 1.414e+28 | 4.0000 ± 0.0000 | +1.639e+30% |" in printed
    assert "| optimizer.lr=1e-3 | 2 | 30.5000 ± 0.7071 | 4.0000 ± 0.0000 | +0.00% |" in printed


def test_a_run_without_its_config_joins_the_group_of_a_later_run_that_typed_the_same(tmp_path):
    """'-m seed=0,1' whose job 0 logged its metrics but has no config_resolved.yaml (an older lit_dtrain wrote none;
    it is labelled by what it typed alone) and whose job 1 trained with model.dropout=0.0, beside a run of dropout
    0.1: job 0 counts in job 1's group. Only a run with its config gives a label to join: without that condition
    ('make_groups' without configured[j], a mutant no test killed) the first run that typed the same was job 0
    itself, which kept its own label and made a group of its own, '(all runs)'."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {9: 3.2}, overrides=["seed=0"])
    job1 = write_run(sweep / "1", {9: 3.0}, overrides=["seed=1"])
    other = write_run(tmp_path / "other" / "0", {9: 3.3}, overrides=["model.dropout=0.1", "seed=0"])
    for run, seed, dropout in ((job1, 1, 0.0), (other, 0, 0.1)):
        (run / "config_resolved.yaml").write_text(f"seed: {seed}\nmodel:\n  dropout: {dropout}\n")
        (run / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices: {}\n")
    for run in (sweep / "0", job1, other):
        (run / "summary.json").write_text(json.dumps({"steps": 10}))
    result = compare_runs.compare([str(sweep), str(tmp_path / "other")], ["val/loss"], out=str(tmp_path / "g.png"),
                                  over=["seed"])
    assert result["markdown"].split("\n\n")[1].splitlines()[2:] == [
        "| model.dropout=0.0 | 2 | 3.1000 ± 0.1414 | 3.1000 ± 0.1414 | +0.00% |",
        "| model.dropout=0.1 | 1 | 3.3000 | 3.3000 | +6.45% |",
    ]
