"""How LitLLM builds its optimizer: the weight-decay groups (also under a sharding strategy) and their log line, the
configured settings on a resume, the 8-bit AdamW, and the fused choice under clipping and mixed precision. (The
module's logging and losses are in test_module.py.)"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.models import build_llama
from lit_dtrain.module import build_optimizer
from lit_dtrain.optim import adamw
from tests.unit._module_helpers import tiny_lit, window_loader


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
