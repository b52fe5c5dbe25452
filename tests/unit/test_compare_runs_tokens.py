"""compare_runs.py --x tokens: a run is drawn against the tokens it trained, from its logged train/tokens, step by
step, where a resume changed its tokens per step."""

from __future__ import annotations

import json

from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs


def draw(monkeypatch, seen: list) -> None:
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        {line.get_label(): [float(x) for x in line.get_data()[0]] for line in fig.axes[0].lines}))


def test_a_run_resumed_on_other_ranks_is_drawn_at_the_tokens_it_logged(tmp_path, monkeypatch, capsys):
    """Real runs' logs: a 2 -> 1 -> 2 rank compressed-DDP resume=auto run (batch 4 x 64 tokens a rank, 4 steps a
    start, validating every 4, logging every 2) and a 1-rank run resumed with data.batch_size 8 -> 4 -> 16 (6, 6 and
    5 steps, validating every 3). One rate a run (the median of train/lengths' steps x the ranks) drew the first's
    validations at 2048, 4096, 6144 tokens (2048, 3072, 5120 trained: +20 % at its end) and the second's final one
    at 8704 (9728 trained). From train/tokens they are where the tokens were; past its last point (step 16) at its
    last interval's rate. A run without train/tokens (before it was logged) keeps the one rate, with a note."""
    seen: list = []
    draw(monkeypatch, seen)
    logged = {  # (logged step, train/lengths, train/tokens) every 2 steps; val/loss steps
        "ranks_2_1_2": ([(1, 512, 1024), (3, 1024, 2048), (5, 1536, 2560), (7, 2048, 3072), (9, 2560, 4096),
                         (11, 3072, 5120)], [3, 7, 11, 12], 12),
        "batch_8_4_16": ([(1, 1024, 1024), (3, 2048, 2048), (5, 3072, 3072), (7, 3584, 3584), (9, 4096, 4096),
                          (11, 4608, 4608), (13, 6656, 6656), (15, 8704, 8704)], [2, 5, 8, 11, 14, 17], 17),
    }
    for name, (train, val_steps, steps) in logged.items():
        for old in ("", "_old"):
            w = SummaryWriter(str(tmp_path / f"{name}{old}" / "tb"))
            for step in val_steps:
                w.add_scalar("val/loss", 4.0 - min(step, steps - 1) / 10, step)  # a final validate repeats
            for step, lengths, tokens in train:
                w.add_scalar("train/lengths", lengths, step)
                if not old:
                    w.add_scalar("train/tokens", tokens, step)
            w.close()
            (tmp_path / f"{name}{old}" / "summary.json").write_text(json.dumps({"steps": steps}))
            devices = 2 if name.startswith("ranks") else 1
            (tmp_path / f"{name}{old}" / "config_resolved.yaml").write_text(f"trainer: {{devices: {devices}}}\n")
    # a job that failed before logging (no config either): nothing drawn, no tokens asked for (they were: an error)
    SummaryWriter(str(tmp_path / "failed" / "tb")).close()
    runs = [str(tmp_path / name) for name in ("ranks_2_1_2", "batch_8_4_16", "ranks_2_1_2_old", "failed")]
    assert compare_runs.main([*runs, "--out", str(tmp_path / "c.png"), "--x", "tokens"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert seen[0] == {"ranks_2_1_2": [2048, 3072, 5120], "batch_8_4_16": [1536, 3072, 3840, 4608, 7680, 9728],
                       "ranks_2_1_2_old": [2048, 4096, 6144]}
    assert [(r.get("tokens_from"), r.get("tokens_per_step")) for r in result["runs"][:3]] == [
        ("train/tokens", 5120 / 12), ("train/tokens", 8704 / 16), ("rate", 512)]
    assert "--x tokens: run(s) 'ranks_2_1_2_old' logged no 'train/tokens'" in out  # under the tables
    assert result["runs"][3]["label"] == "failed" and "tokens_from" not in result["runs"][3]  # nothing to draw
