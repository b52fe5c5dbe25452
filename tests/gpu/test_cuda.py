"""The trainer and each technique on one CUDA GPU. Skipped without CUDA (CI has none).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest -m gpu tests/gpu

The runs are tiny (the ``TINY`` model of ``tests/conftest.py``): these are device-placement and exactness checks
(every tensor on the right device, a resume bit-identical to the uninterrupted run, the 16-bit paths), not speed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.run_dirs import read_scalars as scalars
from tests.conftest import PYTHON, ROOT, TINY, free_port, subprocess_env

# LIT_DTRAIN_GPU_TESTS_ON_CPU=1 runs the same code on CPU (to check the tests themselves where no GPU is)
ON_CPU = os.environ.get("LIT_DTRAIN_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()), reason="needs a CUDA GPU")]

GPU = [f"trainer.accelerator={'cpu' if ON_CPU else 'gpu'}", "trainer.devices=1", "trainer.precision=bf16-mixed"]
EVERY = ["callbacks=[default,loss_spike,selective_ckpt,fourier_sampler,optimizer_diagnostics]", "data/sampler=fourier",
         "data.sampler.step_unit=1", "callbacks.loss_spike.warmup_steps=2",
         "callbacks.optimizer_diagnostics.every_n_steps=2", "trainer.log_every_n_steps=1"]


class DeviceProbe(L.Callback):
    """Where the parameters and the step's token losses are during training (Lightning moves the module back to the
    CPU at the end of ``fit``)."""

    def __init__(self) -> None:
        self.devices: set[tuple[str, str]] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = {p.device.type for p in pl_module.parameters()}
        self.devices.add((",".join(sorted(params)), outputs["token_loss"].device.type))


PROBE = "+callbacks.probe._target_=tests.gpu.test_cuda.DeviceProbe"


@pytest.fixture
def no_process_group_left():
    """A strategy that starts a process group in this process (FSDP, DDP on one device) leaves it to the next test;
    one of NCCL fails the next CPU collective ("No backend type associated with device type cpu")."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def model_state(objects) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in objects["module"].model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), f"max |diff| {worst:.3g}"


def test_bf16_run_with_every_callback_keeps_each_tensor_where_it_belongs(tiny_cfg) -> None:
    from lit_dtrain.callbacks import SelectiveCheckpointing
    from lit_dtrain.train import train

    metrics, objects = train(tiny_cfg(*GPU, *EVERY, PROBE, "trainer.max_steps=12", "trainer.val_check_interval=6"))
    sampler = objects["datamodule"].sampler
    (probe,) = [c for c in objects["trainer"].callbacks if isinstance(c, DeviceProbe)]
    assert probe.devices == {(DEVICE, DEVICE)}
    assert math.isfinite(metrics["val_loss"]) and metrics["val_loss"] < math.log(257)
    # the spectral table lives on CPU (issue #5 point 7) and learned from the CUDA token losses
    for name in ("m1", "m2", "visits", "profile"):
        assert getattr(sampler, name).device.type == "cpu", name
    assert sampler.updates == 12 and int((sampler.visits > 0).sum()) > 0
    assert torch.isfinite(sampler.m1).all() and float(sampler.m1.abs().sum()) > 0
    ckpt = next(c for c in objects["trainer"].callbacks if isinstance(c, SelectiveCheckpointing))
    assert ckpt.plan and all(m == "selective" for m in ckpt.plan)
    assert all(w.calls > 0 for w in ckpt.wrappers)
    tb = scalars(Path(objects["trainer"].default_root_dir))
    for tag in ("fourier/prob_entropy", "fourier/top_band_energy", "val/loss", "train/loss"):
        assert tag in tb and all(math.isfinite(v) for _, v in tb[tag]), (tag, sorted(tb))
    assert any(t.startswith("optim/") for t in tb), sorted(tb)
    if not ON_CPU:  # the peak FLOP/s is known on a GPU (an H200 from lit_dtrain's table, which Lightning's lacks)
        assert "train/device/mfu" in tb and all(0 < v < 1 for _, v in tb["train/device/mfu"]), sorted(tb)


@pytest.mark.parametrize(("optimizer", "lag"), [("adamw", 0), ("adamw8bit", 0), ("adamw", 1)])
def test_resume_is_bit_identical_on_cuda(tiny_cfg, optimizer: str, lag: int) -> None:
    """A run split at step 4 and resumed ends with the weights of the straight 8-step run (deterministic kernels:
    CUBLAS_WORKSPACE_CONFIG must be set before CUDA starts, as the module docstring's command does). With the
    FourierSampler's ``lag=1`` its last update is saved unapplied (copied off the GPU without a wait)."""
    from lit_dtrain.train import train

    if optimizer == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    common = [*GPU, *EVERY, f"optimizer={optimizer}", "trainer.deterministic=true", "trainer.val_check_interval=4",
              "scheduler.total_steps=8", "sample.max_new_tokens=0", f"data.sampler.lag={lag}"]
    _, straight = train(tiny_cfg(*common, "trainer.max_steps=8", run="straight"))
    _, first = train(tiny_cfg(*common, "trainer.max_steps=4", run="split"))
    _, resumed = train(tiny_cfg(*common, "trainer.max_steps=8", "resume=auto", run="split"))
    assert resumed["trainer"].global_step == 8
    opt = resumed["trainer"].optimizers[0]
    if optimizer == "adamw8bit":
        assert "bitsandbytes" in type(opt).__module__
        dtypes = {v.dtype for state in opt.state.values() for v in state.values() if torch.is_tensor(v)}
        assert torch.uint8 in dtypes, dtypes  # 8-bit state (of tensors of >= 4096 values: the embedding)
    assert_same_weights(model_state(straight), model_state(resumed))
    a, b = straight["datamodule"].sampler, resumed["datamodule"].sampler
    assert torch.equal(a.m1, b.m1) and torch.equal(a.visits, b.visits)
    assert a.updates == b.updates == 8 - lag and len(a._pending) == len(b._pending) == lag
    if lag:
        assert torch.equal(a._pending[0].records(), b._pending[0].records())


@pytest.mark.skipif(ON_CPU, reason="which CUDA attention kernel runs")
def test_fp32_grouped_query_attention_runs_the_memory_efficient_kernel(monkeypatch) -> None:
    """fp32 with grouped heads (8 query heads, 2 kv heads) runs under the memory-efficient kernel alone (with
    ``enable_gqa`` no fused kernel takes it), gives the math path's output, and keeps no T x T scores: its peak
    is below that of the grouped form, which runs the math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lit_dtrain.models import build_llama, llama

    torch.manual_seed(0)
    m = build_llama(vocab_size=257, block_size=2048, n_layer=1, n_head=8, n_kv_head=2, d_model=256).cuda()
    x = torch.randint(0, 257, (2, 2048), device="cuda")
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        fused = m(x)
    with sdpa_kernel([SDPBackend.MATH]):
        reference = m(x)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    peaks = {}
    for expand in (False, True):
        monkeypatch.setattr(llama, "expand_kv_heads", lambda q, expand=expand: expand)
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(x).square().mean().backward()
        torch.cuda.synchronize()
        peaks[expand] = torch.cuda.max_memory_allocated() - base
    mib = {k: round(v / 2**20) for k, v in peaks.items()}
    print(f"fp32 GQA T=2048 peak MiB: grouped (math path) {mib[False]}, expanded {mib[True]}")
    assert peaks[True] < 0.7 * peaks[False], peaks


@pytest.mark.skipif(ON_CPU, reason="a GPU-to-host copy")
def test_lag_one_records_a_cuda_index_beside_cpu_token_losses() -> None:
    """Token losses on the CPU, the batch's index still being made on the GPU (behind a ~0.2 s spin): the
    packed records hold the index's values, not pinned memory read before the copy landed."""
    from lit_dtrain.data.samplers import FourierSampler
    from lit_dtrain.data.samplers.fourier_sync import _unpack

    sampler = FourierSampler(stages=False, lag=1)
    sampler.setup(1000, seed=0)
    expected = torch.arange(100, 108)
    torch.cuda._sleep(10**8)  # long enough on any current GPU for a host read to win the race
    index = expected.cuda() + 0  # queued behind the spin
    sampler.observe(torch.rand(8, 256), index, 1)
    records = sampler._pending[0].records()
    assert torch.equal(_unpack(records, sampler.fine_bands)[0], expected)


@pytest.mark.skipif(ON_CPU, reason="whether the host waits for the GPU")
@pytest.mark.parametrize("lag", [0, 1])
def test_observe_waits_for_the_gpu_step_only_without_lag(lag: int) -> None:
    """While the GPU is still busy with a step (a ~0.5 s spin), ``observe`` of that step's token losses returns at
    once with ``lag=1`` and only after the step with ``lag=0``; the lagged update is applied at the next observe."""
    from lit_dtrain.data.samplers import FourierSampler

    sampler = FourierSampler(stages=False, lag=lag)
    sampler.setup(1000, seed=0)
    g = torch.Generator().manual_seed(0)
    index, x = torch.randint(1000, (8,), generator=g).cuda(), torch.rand(8, 256, generator=g).cuda()
    sampler.observe(x * 1.0, index, 1)  # first call: allocations and caches
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    cycles = int(10**7 * 500.0 / start.elapsed_time(end))  # about 500 ms of spinning
    torch.cuda._sleep(cycles)  # the "step": the GPU is busy ...
    loss = x * 2.0  # ... and its token losses come after it
    t0 = time.perf_counter()
    sampler.observe(loss, index, 2)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    if lag:
        assert host_s < 0.1, host_s
        assert sampler.updates == 1  # step 1's, applied at this call
        assert sampler.landed_stats(1) is not None and sampler.landed_stats(2) is None  # step 2's still pending
        sampler.observe(x, index, 3)
        assert sampler.updates == 2 and int(sampler.visits.sum()) > 0
        # step 2's top band energy reached the host with its records: the value lag 0 reads in observe
        reference = FourierSampler(stages=False, lag=0)
        reference.setup(1000, seed=0)
        expected = reference.observe(loss, index, 2)["top_band_energy"]
        landed = sampler.landed_stats(2)
        assert landed is not None and landed["step"] == 2
        assert math.isclose(landed["top_band_energy"], expected, rel_tol=1e-6), (landed, expected)
    else:
        assert host_s > 0.3, host_s
        assert sampler.updates == 2


def test_fp16_grad_scaler_with_a_nan_step_skipped_by_the_spike_monitor(tiny_cfg) -> None:
    from lit_dtrain.callbacks import LossSpikeMonitor
    from lit_dtrain.train import train

    cfg = tiny_cfg(*GPU, "trainer.precision=16-mixed",
                   "callbacks=[default,loss_spike]", "callbacks.loss_spike.warmup_steps=2", "trainer.max_steps=10",
                   "trainer.val_check_interval=5", "+callbacks.inject._target_=tests.unit._loss_spike_helpers.InjectAt",
                   "+callbacks.inject.nan=[6]")
    metrics, objects = train(cfg)
    monitor = next(c for c in objects["trainer"].callbacks if isinstance(c, LossSpikeMonitor))
    assert [e["step"] for e in monitor.events] == [6]
    assert objects["trainer"].precision_plugin.scaler is not None  # a real CUDA GradScaler
    assert all(torch.isfinite(p).all() for p in objects["module"].parameters())
    assert math.isfinite(metrics["val_loss"])


def test_fsdp_on_one_gpu_clips_and_resumes(tiny_cfg, no_process_group_left, monkeypatch) -> None:
    """strategy=fsdp with the default gradient_clip_val=1.0 (Lightning's FSDP plugin refuses clipping by norm; LitLLM
    clips through the root FSDP module), then a resume from its checkpoint."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from lit_dtrain.strategies import EvenEpochsFSDPStrategy
    from lit_dtrain.train import train

    if ON_CPU:
        pytest.skip("Lightning's FSDPStrategy needs CUDA")
    clips = []
    original = FullyShardedDataParallel.clip_grad_norm_

    def counted(self, max_norm, *args, **kwargs):
        clips.append(float(max_norm))
        return original(self, max_norm, *args, **kwargs)

    monkeypatch.setattr(FullyShardedDataParallel, "clip_grad_norm_", counted)
    common = ["trainer.val_check_interval=4", "scheduler.total_steps=8", "sample.max_new_tokens=0"]
    m_plain, _ = train(tiny_cfg(*GPU, *common, "trainer.max_steps=8", run="plain"))
    m_first, first = train(tiny_cfg(*GPU, "strategy=fsdp", *common, "trainer.max_steps=4", run="fsdp"))
    assert type(first["trainer"].strategy) is EvenEpochsFSDPStrategy  # strategy=fsdp's class (make_fsdp)
    assert clips == [1.0] * 4
    m_res, resumed = train(tiny_cfg(*GPU, "strategy=fsdp", *common, "trainer.max_steps=8", "resume=auto", run="fsdp"))
    assert resumed["trainer"].global_step == 8 and clips == [1.0] * 8
    assert math.isfinite(m_res["val_loss"]) and m_res["val_loss"] < m_first["val_loss"]
    # one rank: the same math as no FSDP up to FSDP's bf16 parameter casts
    assert abs(m_res["val_loss"] - m_plain["val_loss"]) < 0.05 * m_plain["val_loss"], (m_res, m_plain)

PRESETS = ["fp16", "bf16", "int8", "int8_rs", "int4", "powersgd", "topk", "sign", "local_sgd", "diloco"]


def test_every_compressed_ddp_preset_trains_on_nccl(tmp_path: Path, corpus: Path) -> None:
    """Each preset as a one-GPU NCCL job (the codec runs on CUDA tensors; bytes are counted as on any world size),
    all presets at once in separate processes."""
    procs = {}
    for preset in PRESETS:
        env = subprocess_env(tmp_path / preset)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        args = [*TINY, *GPU, "data=textfiles", f"data.sources.0.paths=[{corpus}]", f"strategy=ddp_compressed/{preset}",
                "trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.log_every_n_steps=1",
                "sample.max_new_tokens=0", "run_name=r"]
        (tmp_path / preset).mkdir()
        procs[preset] = subprocess.Popen([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path / preset, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed, ratios = {}, {}
    for preset, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failed[preset] = out[-2500:]
            continue
        run_dir = tmp_path / preset / "outputs" / "runs" / "r"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < math.log(257), preset
        tb = scalars(run_dir)
        assert "comm/hook_calls" in tb and tb["comm/hook_calls"][-1][1] > 0, preset
        ratios[preset] = tb.get("comm/compression_ratio", [(0, float("nan"))])[-1][1]
    assert not failed, failed
    print("compression ratios on CUDA:", json.dumps({k: round(v, 3) for k, v in ratios.items()}))
    assert abs(ratios["fp16"] - 2) < 0.01 and abs(ratios["bf16"] - 2) < 0.01
    assert 3.8 < ratios["int8"] < 4.0 and 7.0 < ratios["int4"] < 8.0
    assert all(r > 1.5 for k, r in ratios.items() if k not in ("local_sgd", "diloco")), ratios
