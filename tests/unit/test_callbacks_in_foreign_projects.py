"""lit_dtrain's callbacks imported into a Lightning project that is not lit_dtrain's: a plain LightningModule whose
``training_step`` returns a bare loss tensor, its own optimizer (and LR scheduler), its own DataLoader of ``(x, y)``
tuples, no Hydra. What must work, what must be refused at fit start (naming what is missing and how to provide it),
and that a ``trainer.fit(ckpt_path=...)`` resume of such a module continues each callback exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_dtrain.callbacks import (
    AdaptiveGradClip,
    FourierSamplerCallback,
    LossSpikeMonitor,
    OptimizerDiagnostics,
    SelectiveCheckpointing,
    WSDScheduler,
)
from tests.unit._user_project_helpers import MIXED, UserLM, UserModule, _equal, fit, lm_data

RESUMABLE = {
    "wsd": (lambda tmp: WSDScheduler(total_steps=16, warmup_steps=4, decay_steps=6), {"groups": True}),
    "wsd_two_optimizers": (
        lambda tmp: WSDScheduler(total_steps=16, warmup_steps=4, decay_steps=6),
        {"manual": True, "two": True},
    ),
    "loss_spike": (
        lambda tmp: LossSpikeMonitor(
            actions=["log", "lr_cooldown"],
            warmup_steps=3,
            z_threshold=1.0,
            rel_threshold=None,
            grad_z_threshold=1.0,
            cooldown_steps=2,
            cooldown_ramp_steps=2,
            path=str(tmp / "spikes.jsonl"),
        ),
        {},
    ),
    "adaptive_grad_clip": (lambda tmp: AdaptiveGradClip(warmup_steps=3, z_threshold=1.0), {}),
    "adaptive_grad_clip_two_optimizers": (
        lambda tmp: AdaptiveGradClip(warmup_steps=3, z_threshold=1.0),
        {"manual": True, "two": True},
    ),
    "optimizer_diagnostics": (lambda tmp: OptimizerDiagnostics(every_n_steps=3), {"groups": True}),
    "selective_checkpointing": (lambda tmp: SelectiveCheckpointing(policy="budget", module_pattern="net.*"), {}),
}


@pytest.mark.parametrize(
    ("name", "trainer_kwargs"),
    [(name, {}) for name in sorted(RESUMABLE)]
    + [(name, MIXED) for name in sorted(RESUMABLE) if not RESUMABLE[name][1].get("manual")],
    ids=lambda v: "bf16_accumulate2" if v == MIXED else (v or "fp32"),
)
def test_a_resume_of_the_users_module_continues_each_callback_exactly(tmp_path: Path, name: str, trainer_kwargs):
    """16 steps straight (checkpoint after step 8, an epoch boundary of the user's DataLoader) against 8 steps, then
    ``trainer.fit(ckpt_path=<step 8>)`` with a new callback object: the callback's state and the weights are equal.
    Also under ``bf16-mixed`` with ``accumulate_grad_batches=2`` (manual optimization has no Lightning accumulation)."""
    make, module_kwargs = RESUMABLE[name]
    half = 8 * (2 if module_kwargs.get("two") else 1)  # global_step counts both optimizers' steps: 2 a batch
    straight_cb = make(tmp_path / "a")
    straight = UserModule(**module_kwargs)
    fit(tmp_path / "a", [straight_cb], straight, max_steps=2 * half, save_every=half, **trainer_kwargs)
    (ckpt,) = (tmp_path / "a" / "ckpt").glob(f"*step={half}.ckpt")
    saved = torch.load(ckpt, weights_only=True)["callbacks"].get(straight_cb.state_key)
    if name not in ("optimizer_diagnostics", "selective_checkpointing"):  # (their state does not change in a fit)
        assert saved is not None and not _equal(saved, straight_cb.state_dict()), name  # the resume had work to do
    resumed_cb = make(tmp_path / "b")
    resumed = UserModule(**module_kwargs)
    fit(tmp_path / "b", [resumed_cb], resumed, max_steps=2 * half, ckpt_path=str(ckpt), **trainer_kwargs)
    assert _equal(resumed_cb.state_dict(), straight_cb.state_dict()), name
    for (key, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), (name, key)


def _no_probe_input() -> UserModule:
    module = UserModule()
    module.example_input_array = None
    return module


REFUSED = {
    "selective_checkpointing_without_blocks": (
        lambda tmp: SelectiveCheckpointing(policy="full"),
        UserModule,
        ValueError,
        r"exactly one nn.ModuleList named 'blocks' in UserModule \(found: none\); pass module_pattern .*"
        r"Modules seen: net, net.0, net.1, net.2",
    ),
    "selective_checkpointing_budget_without_probe_input": (
        lambda tmp: SelectiveCheckpointing(policy="budget", module_pattern="net.*"),
        _no_probe_input,
        ValueError,
        r"policy='budget'\) needs a probe input: set UserModule.example_input_array",
    ),
    "loss_spike_skip_without_index": (
        lambda tmp: LossSpikeMonitor(actions=["log", "skip"], path=str(tmp / "s.jsonl")),
        UserModule,
        KeyError,
        r"needs the batch key 'index' .*got list.*actions=\['log', 'lr_cooldown'\]",
    ),
    "loss_spike_manual_optimization": (
        lambda tmp: LossSpikeMonitor(actions=["log"], path=str(tmp / "s.jsonl")),
        lambda: UserModule(manual=True),
        RuntimeError,
        r"LossSpikeMonitor needs automatic optimization, but UserModule sets automatic_optimization = False",
    ),
    "wsd_with_the_modules_own_scheduler": (
        lambda tmp: WSDScheduler(total_steps=8, decay_steps=2),
        lambda: UserModule(scheduler=True),
        RuntimeError,
        r"WSDScheduler sets the LR itself, but the LightningModule also configures LR scheduler\(s\) \['StepLR'\]",
    ),
    "fourier_sampler_without_its_datamodule": (
        lambda tmp: FourierSamplerCallback(),
        UserModule,
        RuntimeError,
        r"FourierSamplerCallback needs trainer.datamodule \(an LMDataModule with a FourierSampler\)",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_a_users_module_does_not_provide_is_refused_before_it_trains(tmp_path: Path, name: str) -> None:
    """A callback that needs something the module or its data do not give fails before the first training step, with
    an error that names what is missing and how to provide it (none of these needed a fix)."""
    make, module_factory, error, match = REFUSED[name]
    module = module_factory()
    with pytest.raises(error, match=match):
        fit(tmp_path, [make(tmp_path)], module, max_steps=4)
    assert module.steps_run == 0, name


def test_fourier_sampler_with_a_users_lm_learns_from_its_token_losses(tmp_path: Path) -> None:
    data, module = lm_data(tmp_path), UserLM(per_token=True)
    fit(tmp_path, [FourierSamplerCallback()], module, max_steps=4, datamodule=data, limit_val_batches=0)
    assert data.sampler.state_dict()["updates"] == 4


@pytest.mark.parametrize("declare", [("loss",), None])
def test_fourier_sampler_callback_names_the_keys_a_users_module_does_not_return(tmp_path: Path, declare) -> None:
    """A module that returns a bare loss: a module that declares ``step_output_keys`` is refused at setup, before any
    training step; one that does not is refused at the end of its first step (the outputs are not known before).
    Either way the message names the missing keys and what they are."""
    from lit_dtrain.callbacks._contract import StepOutputError

    module = UserLM(declare=declare)
    match = (
        r"FourierSamplerCallback needs training_step to return \['token_loss', 'index'\].*"
        r"'token_loss': the per-token loss \[B, T\], detached.*'index': the batch's sample indices"
    )
    with pytest.raises(StepOutputError, match=match):
        fit(
            tmp_path, [FourierSamplerCallback()], module, max_steps=4, datamodule=lm_data(tmp_path), limit_val_batches=0
        )
    assert module.steps_run == (0 if declare else 1)
