"""compare_runs.py by step (the default) says when the runs trained different tokens per optimizer step: a 1-rank
baseline beside a 2-rank ``experiment=compression_sweep`` saw half the tokens at each step, and its val/loss stood
1.88 % behind theirs in the table without a word."""

from __future__ import annotations

import json

from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs


def _run(path, tokens_per_step: int, steps: int = 6) -> str:
    w = SummaryWriter(str(path / "tb"))
    for step in range(steps):
        w.add_scalar("train/tokens", tokens_per_step * (step + 1), step)
    w.add_scalar("val/loss", 3.7, steps - 1)
    w.close()
    (path / "summary.json").write_text(json.dumps({"steps": steps}))
    return str(path)


def test_runs_of_other_tokens_per_step_are_named_under_a_comparison_by_step(tmp_path, capsys):
    runs = [_run(tmp_path / "two_ranks_a", 1024), _run(tmp_path / "two_ranks_b", 1024), _run(tmp_path / "one", 512)]
    assert compare_runs.main([*runs, "--table", str(tmp_path / "t.md")]) == 0
    table = (tmp_path / "t.md").read_text()
    assert "--x step: these runs trained different tokens per optimizer step (1024: 'two_ranks_a', 'two_ranks_b'; " \
           "512: 'one';" in table
    assert "compare them at equal tokens with --x tokens" in capsys.readouterr().out

    assert compare_runs.main([*runs, "--table", str(tmp_path / "t.md"), "--x", "tokens"]) == 0  # the PNG only
    assert "the PNG draws them at equal tokens, but the tables' final and best values are at each run's own steps" \
        in (tmp_path / "t.md").read_text()
    even = [_run(tmp_path / "a", 1024), _run(tmp_path / "b", 1030)]  # within 1 %
    assert compare_runs.main([*even, "--table", str(tmp_path / "t.md")]) == 0
    assert "these runs trained different tokens" not in (tmp_path / "t.md").read_text()
