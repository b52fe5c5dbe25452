"""scripts/compare_runs.py: runs drawn against tokens trained, labels of what the runs trained with, the JSON's
order."""

from __future__ import annotations

import json

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs, write_run


def test_runs_of_other_batch_sizes_are_drawn_against_tokens(tmp_path, monkeypatch, capsys):
    """A sweep over the batch size compared loss at equal steps, the larger batch having seen twice the data.
    ``--x tokens`` draws each run against the steps trained x its tokens per step: train/lengths' rate (its count
    restarting at a resume from an older checkpoint does not change it) times the ranks, the ratio of the global to
    the device train/items_per_sec. A point logged during fit at step s (0-based) is drawn after s + 1 steps."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        (fig.axes[0].get_xlabel(), {line.get_label(): list(line.get_data()[0]) for line in fig.axes[0].lines})))
    # per-rank tokens, ranks, resumed at; 'short' ran on 3 ranks too briefly to log the rates (its config says so)
    runs = {"b2": (64, 1, None), "b4": (128, 1, 5), "b2x2": (64, 2, None), "short": (64, 3, None)}
    for name, (per_rank, ranks, resumed) in runs.items():
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step in range(8):
            w.add_scalar("val/loss", 3.0 - step * 0.1, step)
            done = step + 1 - (resumed if resumed and step >= resumed else 0)
            w.add_scalar("train/lengths", per_rank * done, step)
            if name != "short":
                w.add_scalar("train/device/items_per_sec", 100.0, step)
            if ranks > 1 and name != "short":
                w.add_scalar("train/items_per_sec", 100.0 * ranks, step)
        w.close()
    (tmp_path / "short" / "config_resolved.yaml").write_text("trainer:\n  devices: 3\n  num_nodes: 1\n")
    args = [str(tmp_path / n) for n in runs] + ["--out", str(tmp_path / "c.png"), "--x", "tokens"]
    assert compare_runs.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["tokens_per_step"] for r in result["runs"]] == [64, 128, 128, 192]
    assert seen[0][0].startswith("tokens") and [xs[-1] for xs in seen[0][1].values()] == [512, 1024, 1024, 1536]
    w = SummaryWriter(str(tmp_path / "quiet" / "tb"))  # throughput callback off: no train/lengths
    w.add_scalar("val/loss", 3.0, 1)
    w.close()
    # (or a run shorter than trainer.log_every_n_steps=10: its error named the callback alone, which was on)
    with pytest.raises(compare_runs.CompareError, match=r"--x tokens: run '.*quiet' has no 'train/lengths' .*it was "
                       r"off, or the run stopped before its first logged step\)"):
        compare_runs.compare([str(tmp_path / "b2"), str(tmp_path / "quiet")], ["val/loss"], x="tokens")


def test_validations_are_drawn_at_the_tokens_trained_when_they_measured(tmp_path, monkeypatch):
    """Real runs (model=nano, block_size=64): batch 2 for 8 steps, validating every 4, and batch 4 for 4 steps, every
    2, logged val/loss at 3, 7, 8 and 1, 3, 4 (Lightning's 0-based step during fit, train(cfg)'s final validate at
    the steps trained). ``--x tokens`` drew their validations after 512 tokens at 384 and 256: one batch early, the
    larger batch further back, at equal data. Both are at 512 now, and the final validations at 1024 (8 x 128 and
    4 x 256, not one step later); train/lengths, the tokens trained, lies on x = y."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [{line.get_label(): list(zip(*line.get_data())) for line in ax.lines} for ax in fig.axes]))
    logged = {"b2": (128, 8, [3, 7, 8], [4.0544, 3.6254, 3.6254]), "b4": (256, 4, [1, 3, 4], [4.5342, 4.2693, 4.2693]),
              "b4_6": (256, 6, [3, 6], [4.2693, 4.0]),  # 6 steps, validating every 4: the final validate is new
              "killed": (128, 8, [3, 7], [4.0544, 3.6254])}  # before its final validate: no summary.json
    for name, (per_step, steps, val_steps, values) in logged.items():
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step, value in zip(val_steps, values):
            w.add_scalar("val/loss", value, step)
        for step in range(steps):
            w.add_scalar("train/lengths", per_step * (step + 1), step)
        w.close()
        (tmp_path / name / "config_resolved.yaml").write_text("trainer:\n  devices: 1\n")
        if name != "killed":
            (tmp_path / name / "summary.json").write_text(json.dumps({"steps": steps}))
    runs = [str(tmp_path / name) for name in logged]
    compare_runs.compare(runs, ["val/loss", "train/lengths"], out=str(tmp_path / "c.png"), x="tokens")
    val, lengths = ({label: [float(x) for x, _ in points] for label, points in panel.items()} for panel in seen[0])
    assert val == {"b2": [512, 1024], "b4": [512, 1024], "b4_6": [1024, 1536], "killed": [512, 1024]}
    assert all(x == y for points in seen[0][1].values() for x, y in points) and lengths["b2"][-1] == 1024


def test_a_run_that_logged_no_train_lengths_is_drawn_by_its_config(tmp_path):
    """A real sweep job (max_steps=6, val_check_interval=3, the default log_every_n_steps=10) that failed at step 5
    (NonFiniteError) logged val/loss at step 2 but no train/lengths: '--x tokens' over its sweep stopped with 'run
    ... has no train/lengths'. Its tokens per step come from its config_resolved.yaml now (batch 4 x block 32)."""
    run = write_run(tmp_path / "nan", {2: 5.126})
    (run / "config_resolved.yaml").write_text(
        "data: {batch_size: 4, block_size: 32}\ntrainer: {accumulate_grad_batches: 2, devices: 2, num_nodes: 1}\n")
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")
    assert result["runs"][0]["tokens_per_step"] == 4 * 32 * 2 * 2
    (run / "config_resolved.yaml").write_text("trainer: {devices: 1}\n")  # not train.py's: no batch size
    with pytest.raises(compare_runs.CompareError, match="has no 'train/lengths'"):
        compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")


def test_a_run_that_logged_no_train_lengths_is_drawn_by_the_tokens_it_stepped(tmp_path):
    """A real run with the throughput callback off (callbacks.throughput=null), 5 batches an epoch
    (limit_train_batches) and 2 a step: its 6 steps trained 10 micro-batches of 4 x 64, 2560 tokens, and its config
    drew it at 512 a step, 3072 in all (+20 %). summary.json's stepped tokens give 2560 / 6 now (a resume's: its own
    steps)."""
    run = write_run(tmp_path / "short", {5: 3.85})
    (run / "config_resolved.yaml").write_text(
        "data: {batch_size: 4, block_size: 64}\ntrainer: {accumulate_grad_batches: 2, devices: 1, num_nodes: 1}\n")
    (run / "summary.json").write_text(json.dumps({"steps": 6, "tokens": 2560, "start_step": 0}))
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")
    assert result["runs"][0]["tokens_per_step"] == 2560 / 6
    (run / "summary.json").write_text(json.dumps({"steps": 6, "tokens": 1024, "start_step": 4}))  # resumed at 4
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")
    assert result["runs"][0]["tokens_per_step"] == 512
    (run / "summary.json").write_text(json.dumps({"steps": 6}))  # a summary from before these keys: the config's
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")
    assert result["runs"][0]["tokens_per_step"] == 512
    w = SummaryWriter(str(run / "tb"), filename_suffix=".lengths")  # logged: train/lengths' rate comes first
    for step in range(6):
        w.add_scalar("train/lengths", 400 * (step + 1), step)
    w.close()
    (run / "summary.json").write_text(json.dumps({"steps": 6, "tokens": 2560, "start_step": 0}))
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")
    assert result["runs"][0]["tokens_per_step"] == 400


def test_labels_name_what_the_runs_trained_with_not_only_what_was_typed(tmp_path):
    """A baseline run with the default LR beside one with ``optimizer.lr=1e-2`` was labelled by its dir name, and a
    run that typed ``scheduler=wsd`` (the default) beside one that did not was labelled 'scheduler=wsd', as if its
    schedule differed. Labels are checked against each run's config_resolved.yaml and config-group choices now."""
    runs = {
        "a": (["scheduler=wsd", "trainer.max_steps=12"], "wsd", 0.003),
        "b": (["optimizer.lr=1e-2", "trainer.max_steps=12"], "wsd", 0.01),
        "c": (["scheduler=cosine", "trainer.max_steps=12"], "cosine", 0.003),
    }
    for name, (overrides, scheduler, lr) in runs.items():
        run = write_run(tmp_path / name, {12: 3.0}, overrides=overrides)
        (run / "config_resolved.yaml").write_text(f"optimizer:\n  lr: {lr}\ntrainer:\n  max_steps: 12\n")
        (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      scheduler: {scheduler}\n")
    labels = [r["label"] for r in compare_runs.compare([str(tmp_path / n) for n in runs], ["val/loss"])["runs"]]
    assert labels == ["scheduler=wsd optimizer.lr=0.003", "optimizer.lr=1e-2 scheduler=wsd",
                      "scheduler=cosine optimizer.lr=0.003"]
    two = [r["label"] for r in compare_runs.compare([str(tmp_path / "a"), str(tmp_path / "b")], ["val/loss"])["runs"]]
    assert two == ["optimizer.lr=0.003", "optimizer.lr=1e-2"]
    (tmp_path / "b" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=3e-3\n- trainer.max_steps=12\n")
    (tmp_path / "b" / "config_resolved.yaml").write_text("optimizer:\n  lr: 0.003\ntrainer:\n  max_steps: 12\n")
    three = [r["label"] for r in compare_runs.compare([str(tmp_path / n) for n in "bac"], ["val/loss"])["runs"]]
    assert three == ["scheduler=wsd (b)", "scheduler=wsd (a)", "scheduler=cosine"]  # 3e-3 typed is the default 0.003


def test_the_jsons_runs_are_in_the_tables_order(tmp_path):
    """``compare_runs.py SWEEP/1 SWEEP/0``: the table lists job 0 then job 1 (a sweep's jobs in job order), but the
    JSON's runs kept the order they were found in, 1 then 0, so a script reading runs[0] read another run than the
    table's first row."""
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(["1e-3", "3e-3"]):
        write_run(sweep / str(i), {5: 3.0 - i * 0.1}, overrides=[f"optimizer.lr={lr}"])
    result = compare_runs.compare([str(sweep / "1"), str(sweep / "0")], ["val/loss"])
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    assert [line.split(" | ")[0] for line in result["markdown"].splitlines()[2:]] == [
        "| optimizer.lr=1e-3", "| optimizer.lr=3e-3"]


def test_a_multi_select_groups_choice_labels_a_run_as_typed(tmp_path):
    """A run whose callbacks list came from its config beside one that typed 'callbacks=[default]': its choice (a
    list in .hydra/hydra.yaml) is written as it would be typed, not as Python's list repr."""
    runs = {"d": ([], "[default, loss_spike]"), "e": (["callbacks=[default]"], "[default]")}
    for name, (typed, choice) in runs.items():
        run = write_run(tmp_path / name, {12: 3.0}, overrides=["trainer.max_steps=12", *typed])
        (run / "config_resolved.yaml").write_text("trainer:\n  max_steps: 12\n")
        (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      callbacks: {choice}\n")
    two = [r["label"] for r in compare_runs.compare([str(tmp_path / "d"), str(tmp_path / "e")], ["val/loss"])["runs"]]
    assert two == ["callbacks=[default,loss_spike]", "callbacks=[default]"]


def test_a_run_without_the_experiment_another_used_is_labelled_experiment_null(tmp_path):
    """A baseline run beside a job of '-m experiment=wsd_vs_cosine': the baseline's choice of the group, none
    (null in .hydra/hydra.yaml), was labelled 'experiment=None', which typed is no option of the group (Hydra looks
    for experiment/None.yaml); it is written as it would be typed, 'experiment=null'."""
    runs = {"base": ([], "null"), "exp": (["experiment=wsd_vs_cosine"], "wsd_vs_cosine")}
    for name, (typed, choice) in runs.items():
        run = write_run(tmp_path / name, {12: 3.0}, overrides=["trainer.max_steps=12", *typed])
        (run / "config_resolved.yaml").write_text("trainer:\n  max_steps: 12\n")
        (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      experiment: {choice}\n")
    two = [r["label"] for r in compare_runs.compare([str(tmp_path / n) for n in runs], ["val/loss"])["runs"]]
    assert two == ["experiment=null", "experiment=wsd_vs_cosine"]
