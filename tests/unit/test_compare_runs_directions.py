"""compare_runs.py ranks each scalar tag lit_dtrain logs in its own direction (``TAG_DIRECTIONS``).

Every tag was ranked lower-is-better until a first list left out LRs, multipliers and counters; the Fourier sampler's
``fourier/prob_entropy`` and ``fourier/top_band_energy``, ``spike/loss_z``, ``train/time`` (the time since the fit
started, lowest at the first point) and ``comm/hook_calls`` were still "best" where lowest, and
``comm/compression_ratio`` (dense bytes / bytes sent) where its run compressed least. tests/e2e/test_scalar_axes.py
checks that every tag of a run with every callback is listed; the ``comm/*`` tags need DDP and are read here from
the code that logs them.
"""

from __future__ import annotations

import json

from torch.utils.tensorboard import SummaryWriter

from tests.conftest import load_script

compare_runs = load_script("compare_runs", "compare_runs")


def test_the_left_over_tags_are_unranked_and_the_compression_ratio_is_better_higher():
    tags = {
        "fourier/prob_entropy": None, "fourier/top_band_energy": None, "spike/loss_z": None, "train/time": None,
        "comm/hook_calls": None, "train/grad_norm": None, "grad_clip/opt1/threshold": None,
        "optim/opt0/decay/grad_rms": None, "lr-AdamW/decay-effective": None, "lr-SGD-momentum": None,
        "comm/compression_ratio": True, "train/mfu": True, "validate/device/flops_per_sec": True,
        "val/loss": False, "val/stdlib/loss": False, "val/ppl": False, "validate/time": False,
        "comm/bytes_per_step_avg": False, "spike/count": False,
        "my/own_metric": False,  # a tag no pattern lists: lower-is-better, as a loss
    }
    assert {tag: compare_runs.direction(tag) for tag in tags} == tags
    assert compare_runs.direction("train/time", ["train/time"]) is True  # --maximize still wins
    listed = compare_runs.listed_direction
    assert [listed(tag)[0] for tag in ("my/own_metric", "val/loss", "fourier/prob_entropy")] == [False, True, True]


def test_every_comm_tag_is_listed():
    from lit_dtrain.strategies.comm import CommSession

    session = CommSession()
    session.total_bytes = session.total_dense_bytes = 1  # (the ratio is logged once something was sent)
    metrics = session.metrics()
    assert "comm/compression_ratio" in metrics
    assert [tag for tag in metrics if not compare_runs.listed_direction(tag)[0]] == []


def test_an_unranked_tag_has_no_best_run(tmp_path, capsys):
    """``compare_runs.py RUN... --metric fourier/prob_entropy`` named the run with the lowest entropy 'best'."""
    for name, value in (("a", 3.0), ("b", 2.0)):
        w = SummaryWriter(str(tmp_path / name / "tb"))
        w.add_scalar("fourier/prob_entropy", value, 5)
        w.close()
    args = [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c.png"), "--metric",
            "fourier/prob_entropy"]
    assert compare_runs.main(args) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["best"] is None
    assert "| b | 5 | 2.0000 | - | - |" in out
