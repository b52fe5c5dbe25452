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

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.conftest import load_script

compare_runs = load_script("compare_runs", "compare_runs")


def test_the_left_over_tags_are_unranked_and_the_compression_ratio_is_better_higher():
    tags = {
        "fourier/prob_entropy": None, "fourier/top_band_energy": None, "spike/loss_z": None, "train/time": None,
        "comm/hook_calls": None, "train/grad_norm": None, "data/share/stdlib": None, "grad_clip/opt1/threshold": None,
        "optim/opt0/decay/grad_rms": None, "lr-AdamW/decay-effective": None, "lr-SGD-momentum": None,
        "comm/compression_ratio": True, "train/mfu": True, "validate/device/flops_per_sec": True,
        "val/loss": False, "val/stdlib/loss": False, "val/ppl": False, "validate/time": False,
        "comm/bytes_per_step_avg": False, "spike/count": False, "memory/peak_rss_mib": False,
        "memory/cuda_peak_allocated_mib": False,
        "my/own_metric": False,  # a tag no pattern lists: lower-is-better, as a loss
    }
    assert {tag: compare_runs.direction(tag) for tag in tags} == tags
    assert compare_runs.direction("train/time", ["train/time"]) is True  # --maximize still wins
    # a memory figure's lowest point is a first row, no run's best: ranked by its final value (the peak RSS so far)
    assert [compare_runs.final_only(t) for t in ("memory/peak_rss_mib", "memory/cuda_reserved_mib", "val/loss")] == [
        True, True, False]
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
    assert "| b | 6 | 2.0000 | - | - |" in out


def test_a_cumulative_tag_is_ranked_by_its_final_value_and_has_no_best(tmp_path):
    """``--metric spike/count`` (and ``fourier/nonfinite_skipped``, ``comm/bytes_per_step_avg``): a count or
    running average since the start is 0 at step 1 in every run, so each row's best was '0.0000 (1)', the first
    point, not a value any run reached at its end. Such a tag is ranked by its final value alone now: the best run
    and the gaps are by the final, the best column says so and holds no value."""
    for name, counts in (("a", {1: 0.0, 10: 1.0, 20: 2.0}), ("b", {1: 0.0, 10: 1.0, 20: 1.0})):
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step, value in counts.items():
            w.add_scalar("spike/count", value, step)
            w.add_scalar("comm/bytes_per_step_avg", value * 1000, step)
        w.close()
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    result = compare_runs.compare(runs, ["spike/count", "comm/bytes_per_step_avg"], out=str(tmp_path / "c.png"))
    assert result["best_by_metric"] == {"spike/count": "b", "comm/bytes_per_step_avg": "b"}
    nan = pytest.approx(float("nan"), nan_ok=True)
    assert [(r["best"], r["best_step"]) for r in result["runs"]] == [(nan, None)] * 2
    assert result["markdown"].splitlines()[:4] == [
        "| run | steps trained | final spike/count | best (cumulative: ranked by final) | vs best final |",
        "|---|---:|---:|---:|---:|",
        "| a | 21 | 2.0000 | - | +100.00% |",
        "| b | 21 | 1.0000 | - | +0.00% |",
    ]
    assert "| a | 21 | 2000.0000 | - | +100.00% |" in result["markdown"]
    assert compare_runs.final_only("fourier/nonfinite_skipped") and not compare_runs.final_only("val/loss")


def test_a_step_without_a_sync_is_no_per_step_comm_value(tmp_path):
    """Under local updates ``comm/bytes_per_step`` and ``comm/time_ms`` are 0 on every step that does not sync: a
    local-SGD run whose last logged step did not sync had the final 0 and was the best run (and every run's best was
    0 at such a step). Those points measure no sync: the final and best are the logged syncs'; a run that logged no
    sync has no value."""
    runs = {"ddp": {2: 800.0, 4: 900.0, 6: 800.0}, "local": {2: 0.0, 4: 1000.0, 6: 0.0}, "never": {2: 0.0, 4: 0.0}}
    for name, points in runs.items():
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step, value in points.items():
            w.add_scalar("comm/bytes_per_step", value, step)
            w.add_scalar("comm/time_ms", value / 100, step)
        w.close()
    result = compare_runs.compare([str(tmp_path / n) for n in runs], ["comm/bytes_per_step", "comm/time_ms"],
                                  out=str(tmp_path / "c.png"))
    assert result["best_by_metric"] == {"comm/bytes_per_step": "ddp", "comm/time_ms": "ddp"}
    rows = {r["label"]: r for r in result["runs"]}
    assert (rows["local"]["final"], rows["local"]["final_step"], rows["local"]["best"]) == (1000.0, 5, 1000.0)
    assert (rows["ddp"]["best"], rows["ddp"]["best_step"]) == (800.0, 3)
    assert "| local | 5 | 1000.0000 | 1000.0000 (5) | +25.00% |" in result["markdown"]
    assert "| never | no sync logged | - | - | - |" in result["markdown"]


def test_the_compression_ratio_is_ranked_by_its_final_value(tmp_path):
    """``comm/compression_ratio`` is all dense bytes / all bytes sent since the start. A 2-rank
    ``experiment=compression_sweep`` (8 steps) logged 4, 5, 6, 7, 4 for ``local_sgd_adaptive`` (it climbs between
    syncs, falls at each): the table gave that run the best '7.0000 (7)', a ratio it never had overall (4 at its
    end), and top-k's best was its first step's. It is ranked by its final value alone now, higher better."""
    runs = {"local_sgd": {3: 4.0, 4: 5.0, 5: 6.0, 6: 7.0, 7: 4.0}, "topk": {0: 49.997, 7: 49.986}}
    for name, points in runs.items():
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step, value in points.items():
            w.add_scalar("comm/compression_ratio", value, step)
        w.close()
    result = compare_runs.compare([str(tmp_path / n) for n in runs], ["comm/compression_ratio"],
                                  out=str(tmp_path / "c.png"))
    assert result["best_by_metric"] == {"comm/compression_ratio": "topk"}
    assert result["markdown"].splitlines()[:4] == [
        "| run | steps trained | final comm/compression_ratio | best (cumulative: ranked by final) | vs best final |",
        "|---|---:|---:|---:|---:|",
        "| local_sgd | 8 | 4.0000 | - | -92.00% |",
        "| topk | 8 | 49.9860 | - | +0.00% |",
    ]
