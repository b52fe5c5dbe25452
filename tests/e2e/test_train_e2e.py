"""End to end: train.py as a subprocess, resume exactness, sweeps, 2-process DDP, generation."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from lit_dtrain.train import train
from tests.conftest import PYTHON, ROOT, TINY, load_script, subprocess_env


def run_train(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
        capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_train_py_writes_summary_and_checkpoint(tmp_path, corpus):
    proc = run_train([*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "run_name=e2e"], tmp_path)
    run_dir = tmp_path / "outputs" / "runs" / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    assert 0 < summary["train_loss"] < 6.0
    assert 0 < summary["val_loss"] < 6.0  # below ln(257) = 5.55 + margin: it learned something
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "config_resolved.yaml").is_file()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert "summary: val_loss=" in proc.stdout and "--- sample ---" in proc.stdout
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)  # loadable without code execution
    assert ckpt["global_step"] == 6


def test_resume_is_exact(tiny_cfg):
    n = 4
    common = ["trainer.val_check_interval=2", f"scheduler.total_steps={2 * n}", "sample.max_new_tokens=0"]
    _, straight = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", run="straight"))
    _, first = train(tiny_cfg(*common, f"trainer.max_steps={n}", run="split"))
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    _, resumed = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", f"ckpt_path={ckpt}", run="split"))
    a = straight["module"].model.state_dict()
    b = resumed["module"].model.state_dict()
    assert resumed["trainer"].global_step == 2 * n
    assert resumed["datamodule"].micro_step == straight["datamodule"].micro_step == 2 * n
    for k in a:
        assert torch.equal(a[k], b[k]), k
    opt_a = straight["trainer"].optimizers[0].state_dict()["state"]
    opt_b = resumed["trainer"].optimizers[0].state_dict()["state"]
    assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)


def test_resume_auto_picks_last_ckpt(tiny_cfg):
    _, first = train(tiny_cfg("trainer.max_steps=3", "scheduler.total_steps=6", run="auto"))
    metrics, second = train(tiny_cfg("trainer.max_steps=6", "scheduler.total_steps=6", "resume=auto", run="auto"))
    assert second["trainer"].global_step == 6
    assert second["datamodule"].micro_step == 6  # continued the data stream, did not restart it
    assert metrics["tokens_per_sec"] > 0  # counted from the resumed step, not from the overwritten file


@pytest.mark.parametrize("accumulate", [1, 2])
def test_validation_and_best_checkpoint_follow_optimizer_steps(tiny_cfg, accumulate):
    """Validation comes every val_check_interval *optimizer* steps (Lightning counts micro-batches), and the best
    checkpoint is saved after that validation, named and ranked by its val/loss (it used to carry the previous
    validation's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=3", "sample.max_new_tokens=0",
                   f"trainer.accumulate_grad_batches={accumulate}", "trainer.log_every_n_steps=1",
                   run=f"acc{accumulate}")
    _, objects = train(cfg)
    run_dir = Path(objects["trainer"].default_root_dir)
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    val = {e.step: e.value for e in acc.Scalars("val/loss")}
    assert sorted(val)[:2] == [2, 5]  # logged at the 0-based index of optimizer steps 3 and 6 (6 again: final)
    (best,) = [p.name for p in (run_dir / "checkpoints").glob("step*.ckpt")]
    step = min((2, 5), key=lambda s: val[s]) + 1
    assert best == f"step{step:06d}-val{val[step - 1]:.4f}.ckpt"


def test_a_run_dir_with_checkpoints_is_not_started_over(tiny_cfg):
    """A fresh run in a run dir that holds checkpoints would write last-v1.ckpt beside the old last.ckpt, and a
    later resume=auto would pick the old run's; it is refused with a message that says what to do."""
    from lit_dtrain.train import ConfigError

    common = ["trainer.max_steps=2", "trainer.val_check_interval=2", "sample.max_new_tokens=0"]
    _, first = train(tiny_cfg(*common, run="reused"))
    ckpt_dir = Path(first["trainer"].default_root_dir) / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpt_dir.iterdir()}
    with pytest.raises(ConfigError, match="already holds checkpoints of an earlier run.*resume=auto"):
        train(tiny_cfg(*common, "seed=7", run="reused"))
    assert {p.name: p.read_bytes() for p in ckpt_dir.iterdir()} == before  # nothing written, nothing overwritten
    _, resumed = train(tiny_cfg("trainer.max_steps=4", "trainer.val_check_interval=2", "sample.max_new_tokens=0",
                                "resume=auto", run="reused"))
    assert resumed["trainer"].global_step == 4


def test_resuming_a_finished_run_keeps_its_summary(tiny_cfg):
    common = ["trainer.max_steps=2", "trainer.val_check_interval=2", "sample.max_new_tokens=0"]
    first, objects = train(tiny_cfg(*common, run="done"))
    summary = Path(objects["trainer"].default_root_dir) / "summary.json"
    again, _ = train(tiny_cfg(*common, "resume=auto", run="done"))  # nothing left to train: validates only
    kept = json.loads(summary.read_text())  # strict JSON (no NaN)
    assert kept["steps"] == 2 and kept["val_loss"] == pytest.approx(first["val_loss"])
    assert kept["tokens_per_sec"] == pytest.approx(first["tokens_per_sec"]) and first["tokens_per_sec"] > 0
    assert kept["train_loss"] == pytest.approx(first["train_loss"])


def test_logger_none_trains_without_the_lr_monitor(tiny_cfg):
    from lightning.pytorch.callbacks import LearningRateMonitor

    metrics, objects = train(tiny_cfg("logger=none", "trainer.max_steps=2", "trainer.val_check_interval=2",
                                      "sample.max_new_tokens=0", run="nolog"))
    assert objects["trainer"].logger is None and objects["trainer"].global_step == 2
    assert not any(isinstance(c, LearningRateMonitor) for c in objects["trainer"].callbacks)
    assert not (Path(objects["trainer"].default_root_dir) / "tb").exists() and metrics["val_loss"] < 6.0


def test_mixed_precision_with_grad_clipping_trains(tiny_cfg):
    """Lightning refuses to clip a fused optimizer's grads under AMP; the automatic choice falls back to
    foreach AdamW there (it used to crash `trainer=gpu` and `trainer.precision=bf16-mixed` at step 0)."""
    common = ["trainer.max_steps=2", "trainer.val_check_interval=2", "sample.max_new_tokens=0"]
    metrics, objects = train(tiny_cfg(*common, "trainer.precision=bf16-mixed", run="bf16"))
    assert objects["trainer"].global_step == 2 and objects["trainer"].gradient_clip_val == 1.0
    assert not objects["trainer"].optimizers[0].defaults["fused"] and 0 < metrics["val_loss"] < 6.0
    _, fp32 = train(tiny_cfg(*common, run="fp32"))
    assert fp32["trainer"].optimizers[0].defaults["fused"]  # still fused where clipping allows it
    with pytest.raises(ValueError, match="optimizer.fused=true cannot be combined with trainer.gradient_clip_val"):
        train(tiny_cfg(*common, "trainer.precision=bf16-mixed", "optimizer.fused=true", run="bf16_fused"))


@pytest.mark.slow
def test_multirun_sweep_has_one_dir_per_job(tmp_path, corpus):
    run_train(["-m", *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "optimizer.lr=1e-3,3e-3"], tmp_path)
    summaries = sorted((tmp_path / "outputs" / "multiruns").glob("*/*/summary.json"))
    assert len(summaries) == 2
    lrs = sorted(float(p.parent.joinpath("config_resolved.yaml").read_text().split("lr: ")[1].split()[0])
                 for p in summaries)
    assert lrs == [1e-3, 3e-3]


@pytest.mark.slow
@pytest.mark.dist
def test_ddp_cpu_two_processes(tmp_path, corpus):
    proc = run_train(
        [*TINY, "trainer=ddp_cpu", *[o for o in TINY if o.startswith("trainer.")],
         "data=textfiles", f"data.sources.0.paths=[{corpus}]", "run_name=ddp"],
        tmp_path, timeout=600,
    )
    run_dir = tmp_path / "outputs" / "runs" / "ddp"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    assert proc.stdout.count("summary: val_loss=") == 1  # reported once, by rank 0
    assert "DistributedSampler" not in proc.stdout + proc.stderr  # LMDataModule splits validation itself, exactly
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert events and len({e.name.split(".")[-2] for e in events}) == 1  # TB logs come from one process (rank 0)
    assert not list(tmp_path.glob("outputs/runs/*/.pl_hydra*"))  # no colliding run dirs
    assert len(list((tmp_path / "outputs" / "runs").iterdir())) == 1


def test_generate_script_samples_from_checkpoint(tiny_cfg, tmp_path, capsys):
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", run="gen"))
    ckpt = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    args = [str(ckpt), "--prompt", "ab", "--max-new-tokens", "10", "--seed", "1", "--top-k", "5"]
    out = subprocess.run([PYTHON, str(ROOT / "scripts" / "generate.py"), *args], capture_output=True, text=True,
                         env=subprocess_env(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout.strip().splitlines()[-1]
    payload = json.loads(text)
    assert payload["text"].startswith("ab") and payload["new_tokens"] == 10
    # the same command again, in this process (whose global RNG has drawn plenty since it started): one fresh
    # Python per command cost ~5 s of imports each
    generate = load_script("generate")
    capsys.readouterr()
    generate.main(args)
    assert capsys.readouterr().out == out.stdout  # seeded: reproducible
    generate.main([str(ckpt), "--prompt", "", "--max-new-tokens", "7"])  # an empty prompt starts a new document
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_tokens"] == 7  # (from EOS), no crash


def test_tokens_per_sec_excludes_startup(tiny_cfg, monkeypatch):
    """tokens/s is measured from the start of training, not of trainer.fit: start-up before the first step
    (in a DDP multirun, job 0 alone launches rank 1 and waits for its imports) would make that job look slower
    than an identical later one."""
    import time

    from lit_dtrain.data import LMDataModule

    setup = LMDataModule.setup

    def slow_setup(self, stage=None):
        time.sleep(3.0)  # stands in for start-up that only some jobs of a sweep pay
        return setup(self, stage)

    monkeypatch.setattr(LMDataModule, "setup", slow_setup)
    metrics, objects = train(tiny_cfg("sample.max_new_tokens=0", run="slow_start"))
    dm = objects["datamodule"]
    tokens = metrics["steps"] * dm.batch_size * dm.block_size
    assert metrics["wall_seconds"] > 3.0
    assert tokens / metrics["tokens_per_sec"] < metrics["wall_seconds"] - 2.5  # the 3 s of start-up not counted


def test_spike_loss_z_is_not_logged_during_the_detector_warmup(tiny_cfg):
    """spike/loss_z of a run without spikes stays in a plottable range: before the statistics exist (step 1)
    the z-score used to be logged as 1e6, which flattened every overlaid loss_spike run in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_cfg("callbacks=[default,loss_spike]", "callbacks.progress_bar=null",
                   "callbacks.loss_spike.warmup_steps=2", "trainer.log_every_n_steps=1", "sample.max_new_tokens=0",
                   run="spikes")
    _, objects = train(cfg)
    acc = EventAccumulator(str(Path(objects["trainer"].default_root_dir) / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    z = [(e.step, e.value) for e in acc.Scalars("spike/loss_z")]
    assert z and all(abs(v) < 1e3 for _, v in z), z


def test_continuing_a_finished_run_logs_at_the_same_steps_as_a_straight_run(tiny_cfg):
    """resume=auto from the final last.ckpt with a larger max_steps: every later point is logged at its own
    global step (Lightning bumped its logging counter on restart, so val came at 9, 12, 13 instead of 8, 11, 12)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def logged_steps(objects, tag: str) -> list[int]:
        acc = EventAccumulator(str(Path(objects["trainer"].default_root_dir) / "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        return [e.step for e in acc.Scalars(tag)]

    common = ["trainer.val_check_interval=3", "trainer.log_every_n_steps=2", "sample.max_new_tokens=0"]
    train(tiny_cfg(*common, "trainer.max_steps=6", run="extended"))
    _, extended = train(tiny_cfg(*common, "trainer.max_steps=12", "resume=auto", run="extended"))
    _, straight = train(tiny_cfg(*common, "trainer.max_steps=12", run="straight"))
    assert extended["trainer"].global_step == 12
    for tag in ("val/loss", "train/loss"):
        assert logged_steps(extended, tag) == logged_steps(straight, tag), tag


@pytest.mark.slow  # dynamo traces 4 graphs
def test_each_compiled_job_of_a_process_compiles_its_model(tiny_cfg, monkeypatch):
    """A multirun runs its jobs in one process, and dynamo caches compiled graphs per code object (``Llama.forward``),
    not per model: each job left four there (training, validation under no_grad, the final validate's inference
    tensors, the sample's growing length; two since the sample runs the k/v cache). A sweep over a model shape with
    ``module.compile=true`` reached dynamo's recompile_limit (8) at its third job, which then trained eagerly, with
    only a log warning. Here the limit is one job's two: the second shape compiled nothing before each train() started
    from an empty cache."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()  # dynamo's graphs run eagerly: no C++ build
    compile_in_place = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_in_place(self, backend=counter))
    frames = []
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            for d_model in (32, 48):
                counter.clear()
                train(tiny_cfg("module.compile=true", f"model.d_model={d_model}", "trainer.max_steps=2",
                               "trainer.val_check_interval=2", "sample.max_new_tokens=3", run=f"d{d_model}"))
                frames.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    # train, validation (no_grad, the final validate too: train() turns inference_mode off under compile, which
    # compiled a fourth graph for it); the sample runs the k/v cache's calls of the blocks' submodules, eagerly, not the
    # compiled forward (it compiled a third graph for the sample's dynamic length before the cache)
    assert frames == [2, 2]
