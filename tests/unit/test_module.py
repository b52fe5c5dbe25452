"""LitLLM inside a real Lightning Trainer: what it logs, and how it wires the optimizer."""

from __future__ import annotations

import csv
import functools
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.data import window_batch
from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM, build_optimizer
from lit_dtrain.optim import adamw


def tiny_lit(**kw) -> LitLLM:
    torch.manual_seed(0)
    model = build_llama(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)
    return LitLLM(model, optimizer=functools.partial(adamw, lr=1e-2), **kw)


def window_loader(n_batches: int, batch_size: int = 2, seq: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 257, (n_batches * batch_size, seq + 1), generator=g)
    return [
        window_batch(windows[i : i + batch_size], torch.arange(i, i + batch_size))
        for i in range(0, len(windows), batch_size)
    ]


class MicroLosses(L.Callback):
    """Each optimizer step's micro-batch losses, as Lightning hands them to backward (divided by A)."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[float]] = {}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.by_step.setdefault(trainer.global_step, []).append(float(loss))


def fit(module: LitLLM, tmp_path: Path, steps: int, accumulate: int, callbacks=(), **trainer_kw) -> list[dict]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"log_every_n_steps": 1, **trainer_kw},
    )
    trainer.fit(module, train_dataloaders=DataLoader(window_loader(steps * accumulate), batch_size=None))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_train_loss_under_accumulation_is_the_mean_over_the_steps_micro_batches(tmp_path: Path) -> None:
    """``train/loss`` of an optimizer step with ``accumulate_grad_batches=A`` is the loss of the whole step (the mean
    over its A micro-batches, what the gradient is of), not the loss of its last micro-batch."""
    micro = MicroLosses()
    rows = fit(tiny_lit(), tmp_path, steps=3, accumulate=4, callbacks=[micro])
    logged = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert sorted(logged) == [0, 1, 2]
    for step, value in logged.items():
        losses = micro.by_step[step]
        assert len(losses) == 4
        assert value == pytest.approx(sum(losses), rel=1e-5)  # each is divided by A = 4
        assert abs(value - 4 * losses[-1]) > 1e-4  # the last micro-batch alone differs here


@pytest.mark.parametrize(
    "batch, got",
    [
        ((torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)), "tuple"),
        (torch.zeros(2, 8, dtype=torch.long), "Tensor"),
        ([{"input_ids": torch.zeros(2, 8, dtype=torch.long)}], "list"),
    ],
)
def test_a_batch_that_is_not_a_dict_is_an_error_naming_its_type_and_the_contract(batch, got) -> None:
    """A tuple ``(x, y)`` (the usual DataLoader batch), a bare tensor, or a list of dicts (what Lightning hands
    over when ``fit`` is given a list of batches) was a RuntimeError from inside ``in`` or ``sorted``."""
    with pytest.raises(TypeError, match=rf"LitLLM.*'input_ids'.*'labels'.*a dict.*got a {got}$"):
        tiny_lit().validation_step(batch, 0)


class GradNorms(L.Callback):
    """The total gradient norm of each step as the optimizer is about to see it, before Lightning clips."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.by_step[trainer.global_step] = float(torch.cat(grads).double().norm())


@pytest.mark.parametrize("clip", [0.01, None])
def test_the_gradient_norm_before_clipping_is_logged_at_the_loss_steps(tmp_path: Path, clip) -> None:
    """``train/grad_norm`` is the total norm the step's clipping measured (before clipping, so above a clip of 0.01),
    written at the steps ``train/loss`` is written (every 2nd here); with clipping off it is still measured."""
    probe = GradNorms()
    rows = fit(tiny_lit(), tmp_path, steps=6, accumulate=2, callbacks=[probe], gradient_clip_val=clip,
               log_every_n_steps=2)
    norms = {int(r["step"]): float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")}
    losses = {int(r["step"]) for r in rows if r.get("train/loss")}
    assert sorted(norms) == sorted(losses) == [1, 3, 5]
    for step, norm in norms.items():
        assert norm == pytest.approx(probe.by_step[step], rel=1e-5)
        assert norm > 0.05  # the norm before the clip to 0.01
    assert len(probe.by_step) == 6


@pytest.mark.parametrize(
    "key, bad, named",
    [
        ("input_ids", 300, r"'input_ids' holds token id 300, outside the model's vocabulary \[0, 257\) \(set model"),
        ("labels", 257, r"'labels' holds token id 257, outside the model's vocabulary \[0, 257\) \(set model"),
        ("labels", -100, r"'labels' holds token id -100, .*masks no tokens.*-100 is no ignore index"),
    ],
)
def test_a_token_id_outside_the_vocabulary_is_named_in_training_and_validation(tmp_path, key, bad, named) -> None:
    """A tokenizer larger than the model's vocabulary was torch's "index out of range in self" (CPU) or a
    device-side assert (GPU); a label -100 (an ignore index elsewhere) trained silently as a token of loss 0."""
    batches = window_loader(4)
    batches[0][key][1, 3] = bad
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=named):
        trainer.fit(tiny_lit(), train_dataloaders=DataLoader(batches, batch_size=None))
    with pytest.raises(ValueError, match=named):
        trainer.validate(tiny_lit(), dataloaders=DataLoader(batches, batch_size=None), verbose=False)
    # the check reads the first batch of each loop only, and in-range batches train as before
    module = tiny_lit()
    rows = fit(module, tmp_path / "ok", steps=2, accumulate=1)
    assert module._ids_checked and sum(1 for r in rows if r.get("train/loss")) == 2


def test_a_label_minus_100_after_the_checked_first_batch_fails_instead_of_counting_as_loss_0() -> None:
    """Only the first batch of a loop is range-checked; cross_entropy's default ignore_index then made a later -100
    label a token of loss 0 in the mean, silently (a loss lowered by 1/(B*T) of a token's loss per label)."""
    module = tiny_lit()
    module.log = lambda *a, **k: None  # no trainer attached
    first, later = window_loader(2)
    module.training_step(first, 0)
    assert module._ids_checked  # the next batch is not range-checked
    later["labels"][1, 3] = -100
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        module.training_step(later, 1)
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        module.validation_step(later, 1)


def test_compiled_and_eager_modules_have_the_same_state_dict_keys() -> None:
    """``module.compile=true`` wrapped the model in an ``OptimizedModule``, so every key of its checkpoints gained an
    ``_orig_mod.`` segment: resuming one without compile (another machine, a debugging session), or a run started
    eagerly with compile, failed with 'Missing key(s) in state_dict'. The model is now compiled in place."""
    compiled, eager = tiny_lit(compile=True), tiny_lit()
    compiled.configure_model()
    assert compiled.model._compiled_call_impl is not None  # compiled (forward goes through torch.compile)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    eager.load_state_dict(compiled.state_dict())  # strict: every key matches
    compiled.load_state_dict(eager.state_dict())


def test_a_checkpoint_of_a_model_compiled_as_a_wrapper_loads_into_either_module() -> None:
    """Checkpoints written before the model was compiled in place hold ``model._orig_mod.*`` keys; they still load,
    and a LitLLM given a ``torch.compile`` wrapper by its caller loads either kind too."""
    source = tiny_lit()
    eager_state = source.state_dict()
    wrapped_state = {k.replace("model.", "model._orig_mod.", 1): v for k, v in eager_state.items()}
    wrapped = tiny_lit()
    wrapped.model = torch.compile(wrapped.model)
    for module in (tiny_lit(), tiny_lit(compile=True), wrapped):
        module.configure_model()
        for state in (eager_state, wrapped_state):
            checkpoint = {"state_dict": dict(state)}
            module.on_load_checkpoint(checkpoint)
            module.load_state_dict(checkpoint["state_dict"])  # strict
            got = {k.replace("_orig_mod.", ""): v for k, v in module.state_dict().items()}
            assert got.keys() == eager_state.keys()
            assert all(torch.equal(got[k], v) for k, v in eager_state.items())


def test_flops_per_batch_follows_the_batch_being_measured_train_or_validation(tmp_path: Path) -> None:
    """The ThroughputMonitor reads ``flops_per_batch`` after every train and validation batch. It was the estimate of
    the first train batch, forward + backward, also for validation batches: validate/device/flops_per_sec (and MFU)
    counted the backward pass validation does not run, at the train batch size (val batches are 4x larger by
    default). Validation batches now count their own forward FLOPs."""
    from lit_dtrain.callbacks import token_throughput_monitor
    from lit_dtrain.module import estimate_train_flops

    module = tiny_lit()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, val_check_interval=3, num_sanity_val_steps=0,
        callbacks=[token_throughput_monitor(window_size=2)], logger=CSVLogger(str(tmp_path), name="csv", version=0),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    train = DataLoader(window_loader(3, batch_size=2), batch_size=None)
    val = DataLoader(window_loader(4, batch_size=8), batch_size=None)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))

    def flops_per_batch(stage: str) -> float:
        row = [r for r in rows if r.get(f"{stage}/device/flops_per_sec")][-1]
        return float(row[f"{stage}/device/flops_per_sec"]) / float(row[f"{stage}/device/batches_per_sec"])

    assert flops_per_batch("train") == pytest.approx(estimate_train_flops(module.model, 2, 16), rel=1e-6)
    assert flops_per_batch("validate") == pytest.approx(estimate_train_flops(module.model, 8, 16) / 3, rel=1e-6)


def lit_of(**shape) -> LitLLM:
    config = dict(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=2, d_model=16)
    return LitLLM(build_llama(**{**config, **shape}))


@pytest.mark.parametrize(
    "saved, configured, named",
    [
        ({}, {"n_head": 4, "n_kv_head": 4}, r"n_head=2, n_kv_head=2.*n_head=4, n_kv_head=4"),  # same weight shapes
        ({"tie_embeddings": False}, {"tie_embeddings": True}, r"tie_embeddings=False.*tie_embeddings=True"),
        ({}, {"d_model": 32}, r"d_model=16.*d_model=32"),  # was a wall of 'size mismatch' lines
    ],
)
def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_keys(saved, configured, named) -> None:
    """Resuming a checkpoint into a model of another shape: with heads regrouped (n_head and n_kv_head scaled
    together) or the embeddings tied, every tensor still fits, and the weights loaded silently into a model that
    computes something else. The checkpoint's ``model_config`` is now compared with the model's first."""
    source, target = lit_of(**saved), lit_of(**configured)
    checkpoint = {"state_dict": source.state_dict()}
    source.on_save_checkpoint(checkpoint)
    with pytest.raises(CheckpointError, match=rf"checkpoint.*{named}.*model\.\*"):
        target.on_load_checkpoint(checkpoint)


def test_a_checkpoint_with_another_block_size_or_rope_theta_still_loads() -> None:
    """Neither changes a weight's meaning or shape (RoPE tables are rebuilt from the config): context extension."""
    source, target = lit_of(), lit_of(block_size=64, rope_theta=500000.0)
    checkpoint = {"state_dict": source.state_dict()}
    source.on_save_checkpoint(checkpoint)
    target.on_load_checkpoint(checkpoint)
    target.load_state_dict(checkpoint["state_dict"])


def test_weight_decay_groups_and_flops_do_not_change_when_a_sharding_strategy_flattens_the_parameters() -> None:
    """Lightning's FSDPStrategy (``use_orig_params=True``, built before ``configure_optimizers``) leaves each original
    parameter as a 1-D view of this rank's shard, on 2 or more ranks (pytorch/pytorch#136314). Decay was decided by
    ``p.dim() < 2`` and FLOPs counted from ``p.numel()``: every matrix went to the no-decay group (weight decay off,
    silently) and FLOP/s and MFU counted a shard. Shapes are remembered when LitLLM is built. Simulated here by
    replacing each parameter's data with the first half of it, flattened (FSDP cannot run on CPU)."""
    from lit_dtrain.module import estimate_train_flops, param_groups

    lit = tiny_lit()
    names = {id(p): n for n, p in lit.model.named_parameters()}
    want = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in param_groups(lit.model)}
    want_flops = estimate_train_flops(lit.model, 2, 16)
    assert "blocks.0.attn.wq.weight" in want["decay"] and "norm.weight" in want["no_decay"]
    for p in lit.model.parameters():
        p.data = p.data.flatten()[: max(1, p.numel() // 2)]
    got = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in param_groups(lit.model)}
    assert got == want
    assert estimate_train_flops(lit.model, 2, 16) == want_flops


def test_the_optimizer_logs_its_weight_decay_groups(caplog) -> None:
    """Which parameters an ``optimizer.weight_decay`` applies to was nowhere in a run's log. Building the optimizer now
    logs each group's tensors, parameters (the tied embedding and head once) and weight decay."""
    model = build_llama(vocab_size=257, block_size=16, n_layer=2, n_head=2, n_kv_head=2, d_model=16)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.module_params"):
        build_optimizer(functools.partial(adamw, lr=1e-3, weight_decay=0.05), model, 1.0, "32-true")
    assert caplog.messages == [
        "optimizer AdamW, param groups: decay: 14 tensors, 8,192 parameters, weight_decay 0.05 (w1.weight, w2.weight, "
        "w3.weight, wk.weight, wo.weight, wq.weight, wv.weight); no_decay: 6 tensors, 4,192 parameters, weight_decay "
        "0.0 (attn_norm.weight, mlp_norm.weight, norm.weight, tok_embeddings.weight)"]
    assert 8192 + 4192 == sum(p.numel() for p in model.parameters())


def test_a_resume_trains_with_the_configured_weight_decay_betas_eps_and_fused_choice(tmp_path: Path, caplog) -> None:
    """``optimizer.load_state_dict`` keeps every param-group setting of the checkpoint but its parameters: a resume
    with ``optimizer.weight_decay=0.01 optimizer.betas=[0.8,0.9] optimizer.eps=1e-6`` trained on with the
    checkpoint's 0.1, (0.9, 0.95) and 1e-8, silently, and a 32-true checkpoint's fused AdamW stayed fused under
    bf16-mixed with clipping (built foreach there). The configured values now hold, and the changes are logged."""
    kw = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, default_root_dir=str(tmp_path), gradient_clip_val=1.0)
    data = DataLoader(window_loader(4), batch_size=None)
    L.Trainer(max_steps=2, **kw).fit(tiny_lit(), train_dataloaders=data)
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt"))
    resumed = tiny_lit()
    resumed.optimizer_factory = functools.partial(adamw, lr=1e-2, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-6)
    trainer = L.Trainer(max_steps=3, precision="bf16-mixed", **kw)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.module_params"):
        trainer.fit(resumed, train_dataloaders=data, ckpt_path=str(ckpt))
    groups = trainer.optimizers[0].param_groups
    assert [(g["weight_decay"], tuple(g["betas"]), g["eps"], g["fused"], g["foreach"]) for g in groups] == [
        (0.01, (0.8, 0.9), 1e-6, None, True), (0.0, (0.8, 0.9), 1e-6, None, True)]
    assert ("weight_decay=0.01 in group 'decay' (the checkpoint's: 0.1); betas=(0.8, 0.9) in group 'decay' (the "
            "checkpoint's: (0.9, 0.95)); eps=1e-06 in group 'decay' (the checkpoint's: 1e-08)") in caplog.text


def _assert_nested_equal(a, b, path: str = "") -> int:
    """Assert ``a == b`` (tensors bitwise) through dicts and lists; returns how many uint8 tensors were compared."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), path
        return int(a.dtype == torch.uint8)
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        return sum(_assert_nested_equal(a[k], b[k], f"{path}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        return sum(_assert_nested_equal(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b, path
    return 0


def test_adamw8bit_runs_on_cpu_and_resumes_its_quantized_state_bitwise(tiny_cfg) -> None:
    """optimizer=adamw8bit: bitsandbytes' 8-bit AdamW steps on CPU, its block-wise quantized state (uint8 moments,
    absmax, qmaps) goes into the checkpoint through torch.load(weights_only=True), and a run stopped at step 3 and
    resumed to 6 ends with the weights and optimizer state of a straight 6-step run, bit for bit. d_model=64: bnb
    keeps 32-bit state for tensors under 4096 elements, so the 64x64 matrices exercise the 8-bit path."""
    from lit_dtrain.checkpoint import safe_torch_load
    from lit_dtrain.train import train

    common = ["optimizer=adamw8bit", "model.d_model=64", "scheduler.total_steps=6", "sample.max_new_tokens=0"]
    train(tiny_cfg(*common, "trainer.max_steps=6", run="straight"))
    _, objs = train(tiny_cfg(*common, "trainer.max_steps=3", run="split"))
    split_ckpt = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    train(tiny_cfg(*common, "trainer.max_steps=6", f"ckpt_path={split_ckpt}", run="split"))
    straight, resumed = (
        safe_torch_load(Path(tiny_cfg(run=run).paths.checkpoint_dir) / "last.ckpt") for run in ("straight", "split")
    )
    assert straight["global_step"] == resumed["global_step"] == 6
    _assert_nested_equal(straight["state_dict"], resumed["state_dict"])
    assert _assert_nested_equal(straight["optimizer_states"], resumed["optimizer_states"]) > 0  # 8-bit state compared
    groups = straight["optimizer_states"][0]["param_groups"]
    assert [(g["name"], g["weight_decay"]) for g in groups] == [("decay", 0.1), ("no_decay", 0.0)]


def test_adamw8bit_refuses_float64_parameters() -> None:
    """bitsandbytes' 8-bit AdamW computes in fp32 and writes fp32-rounded values back: a 64-true run's weights were
    exactly fp32 values after every step (all 21 tensors of the tiny model), silently. The factory now refuses float64
    parameters (config_lightning refuses trainer.precision=64-true optimizer=adamw8bit before compute)."""
    from lit_dtrain.optim import adamw8bit

    params = [torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(64))]
    with pytest.raises(ValueError, match=r"optimizer=adamw8bit cannot train float64 parameters: .* optimizer=adamw"):
        adamw8bit([{"params": params}])
    assert type(adamw8bit([{"params": params[1:]}])).__name__ == "AdamW8bit"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_val_loss_sums_stay_fp32_or_wider_when_the_precision_casts_the_module(dtype) -> None:
    """bf16-true (and 16-true) convert the module with ``.to(dtype)``, which cast the val-loss metric's states: the
    sums were accumulated in bf16 and val/loss was a bf16 number (5.4688 for a mean of 5.4805 in a real fit). They
    stay fp32 now (fp64 under 64-true)."""
    lit = tiny_lit(val_names=["a", "b"]).to(dtype)
    token_loss = torch.linspace(1.0, 1.8, 4096).view(16, 256).to(dtype)
    for metric in (lit.val_loss, lit.val_loss_by_source[1]):
        assert metric.mean_value.dtype == metric.weight.dtype == (torch.float64 if dtype == torch.float64 else
                                                                  torch.float32)
        metric.update(token_loss, torch.ones_like(token_loss))
        assert float(metric.compute()) == pytest.approx(float(token_loss.double().mean()), rel=1e-6)


def test_val_loss_is_nan_when_any_window_is_nan() -> None:
    """torchmetrics' MeanMetric drops NaN values by default (with a warning): a model whose logits overflowed on some
    validation windows reported the mean of the others, a healthy-looking val/loss that ModelCheckpoint could keep as
    the best. A NaN token loss now makes val/loss (and the source's) NaN."""
    lit = tiny_lit(val_names=["a", "b"])
    lit.model.register_forward_hook(lambda module, args, out: out.index_fill(0, torch.tensor([0]), float("nan")))
    batch = window_loader(1, batch_size=3)[0]
    with torch.no_grad():
        lit.validation_step(batch, 0, dataloader_idx=1)
    assert torch.isnan(lit.val_loss.compute())
    assert torch.isnan(lit.val_loss_by_source[1].compute())


@pytest.mark.parametrize(
    ("fused", "clip", "precision", "expected"),
    [
        (None, 1.0, "32-true", "fused"),
        (None, 1.0, "bf16-mixed", "foreach"),  # Lightning refuses to clip a fused optimizer's grads under AMP
        (None, None, "bf16-mixed", "fused"),
        (False, 1.0, "32-true", "foreach"),
    ],
)
def test_build_optimizer_is_fused_unless_its_grads_are_clipped_under_mixed_precision(fused, clip, precision, expected):
    model = tiny_lit().model
    optimizer = build_optimizer(functools.partial(adamw, lr=1e-2, fused=fused), model, clip, precision)
    kind = "fused" if optimizer.defaults["fused"] else "foreach" if optimizer.defaults["foreach"] else None
    assert kind == expected



def test_a_fused_optimizer_from_another_factory_is_refused_naming_the_factory():
    """Under a mixed precision with clipping, a fused optimizer built by a factory other than lit_dtrain's adamw was
    refused as 'optimizer.fused=true cannot be combined ...', a key that factory may not have (it was left null)."""
    model = torch.nn.Linear(4, 4)
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, fused=True)
    with pytest.raises(ValueError, match=r"the optimizer built by optimizer._target_ \(AdamW\) unscales its grads "
                                         r"inside step\(\).*trainer.gradient_clip_val=1.0 under precision=bf16-mixed"):
        build_optimizer(factory, model, 1.0, "bf16-mixed")
    with pytest.raises(ValueError, match=r"^optimizer.fused=true cannot be combined"):
        build_optimizer(functools.partial(adamw, lr=1e-3, fused=True), model, 1.0, "bf16-mixed")
    assert not build_optimizer(functools.partial(adamw, lr=1e-3), model, 1.0, "bf16-mixed").defaults["fused"]
    assert build_optimizer(factory, model, None, "bf16-mixed").defaults["fused"]  # no clipping: allowed


def test_the_loss_of_a_float64_model_is_computed_in_float64() -> None:
    """precision=64-true: the token loss was cast down to fp32 (logits.float()), silently."""
    lit = tiny_lit()
    lit.model.double()
    batch = window_loader(1)[0]
    token_loss = lit._token_loss(batch)
    assert token_loss.dtype == torch.float64
    with torch.no_grad():
        logits = lit.model(batch["input_ids"])
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    torch.testing.assert_close(token_loss.detach().flatten(), want, rtol=1e-13, atol=0)


def test_a_64_true_checkpoint_resumes_with_its_float64_weights(tmp_path: Path) -> None:
    """Lightning loads the weights before precision=64-true converts the module: they were copied into the fp32
    model (rounded) and the resumed run continued from fp32-rounded weights."""
    kw = dict(accelerator="cpu", precision="64-true", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    lit = tiny_lit()
    trainer = L.Trainer(max_steps=2, **kw)
    trainer.fit(lit, train_dataloaders=DataLoader(window_loader(4), batch_size=None))
    path = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(path)
    saved = {k: v.clone() for k, v in lit.model.state_dict().items()}
    assert all(v.dtype == torch.float64 for v in saved.values())
    assert any(not torch.equal(v, v.float().double()) for v in saved.values())  # not all fp32 values
    resumed = tiny_lit()
    L.Trainer(max_steps=2, **kw).fit(resumed, train_dataloaders=DataLoader(window_loader(4), batch_size=None),
                                         ckpt_path=path)  # restores only
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, saved[k]), k


class StepLossSeen(L.Callback):
    """At each batch end: the step's loss from its output, and ``train/loss`` as callbacks, the progress bar and the
    loggers' next write see it."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append((float(outputs["loss"]), float(trainer.callback_metrics["train/loss"]),
                          trainer.progress_bar_metrics["train/loss"], float(trainer.logged_metrics["train/loss"])))


def test_train_loss_reaches_callbacks_bar_and_loggers_every_step_with_one_self_log_per_epoch(tmp_path, monkeypatch):
    """``train/loss`` is registered through ``self.log`` once per epoch, then fed to Lightning's stored result
    directly (``module_metrics.log_every_step``: ``self.log`` cost ~0.7 ms of CPU a step); every step's value, in
    ``callback_metrics``, the progress bar and the CSV rows, is that step's loss, across epochs and validations."""
    calls = []
    monkeypatch.setattr(LitLLM, "log", lambda self, name, *a, **k: calls.append(name) or L.LightningModule.log(
        self, name, *a, **k))
    seen = StepLossSeen()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, log_every_n_steps=2, val_check_interval=2,
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), callbacks=[seen],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    batches = DataLoader(window_loader(4), batch_size=None)
    trainer.fit(tiny_lit(), train_dataloaders=batches, val_dataloaders=DataLoader(window_loader(1), batch_size=None))
    assert calls.count("train/loss") == 2  # the first step of each epoch
    assert len(seen.rows) == 8
    for loss, callback, bar, logged in seen.rows:
        assert callback == logged == loss and bar == pytest.approx(loss, abs=0)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert rows == {step: seen.rows[step][0] for step in (1, 3, 5, 7)}


def test_a_steps_first_micro_batch_gives_its_loss_as_the_mean_without_a_tensor_op() -> None:
    """The step's mean loss costs no tensor op (kernel launch) at a step's first micro-batch, the only one without
    accumulation: it was zeros + loss, then / 1 (three ops a step, ~0.13 ms of host CPU); later ones still average."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    module = tiny_lit()
    module._trainer = SimpleNamespace(global_step=3)
    first = torch.tensor(2.0)
    with CountOps():
        assert module._step_mean_loss(first) is first
    assert ops == []
    assert float(module._step_mean_loss(torch.tensor(4.0))) == 3.0  # step 3's second micro-batch: the mean
    module._trainer.global_step = 4
    assert float(module._step_mean_loss(torch.tensor(5.0))) == 5.0
