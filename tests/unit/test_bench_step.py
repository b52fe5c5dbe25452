"""scripts/bench_step.py's plain loop trains exactly as its Lightning side does: the timings compare like for like."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_step", "_bench_step")


@pytest.mark.parametrize(
    "overrides",
    [[], ["trainer.precision=bf16-mixed"], ["trainer.precision=bf16-mixed", "trainer.accumulate_grad_batches=2"]],
    ids=["32-true", "bf16-mixed", "bf16-mixed-accumulate2"],
)
def test_the_plain_loop_and_lightning_have_bitwise_the_same_losses(bench, tmp_path, corpus, overrides):
    """The same batches, init, autocast, optimizer, clipping and schedule: every step's loss is bitwise equal on CPU
    (without the plain loop's autocast the bf16 losses differ by ~1e-3, with clipping in another order by ~1e-5)."""
    cfg = bench.compose_default(str(tmp_path / "run"), 6, [
        *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", f"paths.cache_dir={tmp_path / 'cache'}",
        "scheduler.warmup_steps=2", *overrides,
    ])
    device = bench.bench_device(cfg)
    assert device.type == "cpu"
    _, plain = bench.plain_round(cfg, 1, device)
    _, lightning = bench.lightning_round(cfg, 1, device)
    assert len(plain) == 6
    assert plain == lightning
    assert plain[-1] < plain[0]  # it trains


def test_tokens_per_step_counts_the_accumulated_micro_batches(bench, tmp_path):
    cfg = bench.compose_default(str(tmp_path), 4, ["data.batch_size=3", "model.block_size=16",
                                                   "trainer.accumulate_grad_batches=2"])
    assert bench.tokens_per_step(cfg) == 3 * 16 * 2


def test_a_precision_the_plain_loop_does_not_mirror_is_refused(bench, tmp_path):
    cfg = bench.compose_default(str(tmp_path), 4, ["trainer.precision=16-mixed"])
    with pytest.raises(ValueError, match="16-mixed would need a GradScaler"):
        bench.autocast_dtype(cfg)


def test_loss_log_mode_times_both_train_loss_paths_and_finds_their_results_identical(bench, tmp_path, corpus, capsys,
                                                                                     monkeypatch):
    """``--loss-log``: self.log at every step against log_every_step, alternated; the same losses and the same
    train/loss in callback_metrics at every step, and a CPU time for each call."""
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))  # the script imports its private module by name
    from _bench_step_loss_log import loss_log_rounds

    cfg = bench.compose_default(str(tmp_path / "run"), 4, [
        *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", f"paths.cache_dir={tmp_path / 'cache'}"])
    summary = loss_log_rounds(bench, cfg, rounds=2, warmup=1, device=bench.bench_device(cfg))
    assert summary["identical"] is True
    assert summary["ratio_is"] == "log_every_step/self.log CPU time of the call"  # the JSON's ratio named no side
    assert summary["self_log_us_per_step"] > 0 and summary["log_every_step_us_per_step"] > 0
    assert "self.log" in capsys.readouterr().out


def test_hooks_mode_times_every_hook_of_the_step_train_py_runs(bench, tmp_path, corpus, capsys, monkeypatch):
    """``--hooks``: the main thread's CPU time per step of each hook of the Lightning side, which runs the per-step
    callbacks ``train()`` adds (NonFiniteLossWatch's 6 tensor ops a step went unseen: the side lacked it); and the
    default mode's CPU time per step of both sides."""
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))  # the script imports its private module by name
    from _bench_step_hooks import hook_rounds

    cfg = bench.compose_default(str(tmp_path / "run"), 5, [
        *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", f"paths.cache_dir={tmp_path / 'cache'}"])
    device = bench.bench_device(cfg)
    summary = hook_rounds(bench, cfg, rounds=1, warmup=1, device=device, top=100)
    hooks = summary["hooks_us"]
    assert hooks["run_training_batch"] == max(hooks.values()) and summary["step_cpu_ms"] > 0
    assert hooks["[LightningModule]LitLLM.optimizer_step"] <= hooks["run_training_batch"]
    for hook in ("[Callback]NonFiniteLossWatch.on_train_batch_end", "[Callback]LogStepSync.on_train_batch_start",
                 "[LightningModule]LitLLM.on_before_optimizer_step", "[Callback]ModelCheckpoint.on_train_batch_end"):
        assert 0 < hooks[hook] < hooks["run_training_batch"], hook
    cpu: list[float] = []
    bench.plain_round(cfg, 1, device, cpu)
    timer = bench.StepTimer(device)
    bench.lightning_round(cfg, 1, device, timer=timer)
    assert len(cpu) == 1 and cpu[0] > 0 and timer.cpu_ms > 0


@pytest.mark.parametrize("devices, one", [("1", True), ("auto", True), ("[0]", True), ("2", False), ("[0,1]", False),
                                          ("-1", False)])
def test_only_a_config_of_one_process_is_timed(bench, tmp_path, devices, one):
    """The plain loop is one process: a config of several (``experiment=compression_sweep``'s ``trainer=ddp_cpu``)
    failed inside Lightning's fit on both ranks, after a plain round; Lightning's ``auto`` on CPU is one."""
    cfg = bench.compose_default(str(tmp_path), 4, ["trainer=cpu", f"trainer.devices={devices}"])
    if one:
        bench.one_process(cfg, bench.bench_device(cfg))
    else:
        with pytest.raises(ValueError, match=r"is not one process: add trainer.devices=1 .* scripts/bench_comm.py"):
            bench.one_process(cfg, bench.bench_device(cfg))


def test_the_ratio_line_and_the_json_say_which_side_is_over_which(bench, tmp_path, capsys, monkeypatch):
    """The printed 'ratio 1.004' and the JSON's ``"ratio"`` named neither side; only the docs said Lightning / plain.
    Rounds faked at 100 ms (plain) and 125 ms (Lightning) per step: the ratio is 1.25 and both say so."""
    def plain_round(cfg, warmup, device, cpu_ms=None):
        cpu_ms.append(10.0)
        return 100.0, []

    def lightning_round(cfg, warmup, device, timer=None, profiler=None):
        timer.cpu_ms = 12.0
        return 125.0, []

    monkeypatch.setattr(bench, "plain_round", plain_round)
    monkeypatch.setattr(bench, "lightning_round", lightning_round)
    monkeypatch.setattr("sys.argv", ["bench_step.py", "--steps", "3", "--warmup", "1", "--rounds", "1", *TINY])
    bench.main()
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["ratio"] == 1.25 and result["ratio_is"] == "lightning/plain ms per step"
    assert "ratio lightning/plain ms per step 1.250 (above 1: Lightning is slower)" in out[-2]
