"""LitLLM's gradient norm of a step: computed once for the non-finite check, ``train/grad_norm`` and the clip, with
the clipped gradients bitwise those of Lightning's own clip (lit_dtrain.module_grads)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lit_dtrain.module import LitLLM, NonFiniteError
from lit_dtrain.module_grads import StepGradNorm
from tests.unit._module_helpers import fit, tiny_lit


class LightningClip(LitLLM):
    """LitLLM with Lightning's own clipping (``clip_grad_norm_`` in its precision plugin), and no logged norm."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        L.LightningModule.configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm)


class TotalNorms(L.Callback):
    """``get_total_norm`` of each step's gradients before the clip (callbacks run before LitLLM's hook)."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.by_step[trainer.global_step] = float(torch.nn.utils.get_total_norm(grads))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_one_gradient_norm_per_step_and_the_clip_is_bitwise_lightnings(tmp_path: Path, monkeypatch, precision) -> None:
    """Each step took the norm of every gradient three times (the non-finite check, train/grad_norm, Lightning's
    clip), ~0.7 ms each for the default model on a CPU; now once. Weights and logged norms are unchanged: a clip of
    0.01 (it scales every step here) leaves the weights bitwise those of Lightning's own clip."""
    passes = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: passes.append(1) or real(*a, **k))
    probe = TotalNorms()
    ours = tiny_lit()
    rows = fit(ours, tmp_path / "ours", steps=4, accumulate=1, callbacks=[probe], gradient_clip_val=0.01,
               precision=precision)
    assert len(passes) - len(probe.by_step) == 4  # (the probe's own pass aside) one per step
    logged = {int(r["step"]): float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")}
    assert logged == probe.by_step and min(logged.values()) > 0.01  # every step logged, each clipped

    monkeypatch.setattr(torch, "_foreach_norm", real)
    torch.manual_seed(0)
    theirs = LightningClip(tiny_lit().model, optimizer=ours.optimizer_factory)
    fit(theirs, tmp_path / "theirs", steps=4, accumulate=1, gradient_clip_val=0.01, precision=precision)
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)


def test_the_kept_norm_is_recomputed_when_a_gradient_changes_or_is_replaced() -> None:
    a, b = torch.ones(3), torch.ones(4)
    norms = StepGradNorm()
    first = norms.total([a, b])
    assert norms.total([a, b]) is first  # the same, unmodified tensors: kept
    a.mul_(2)  # in place (a clip, a callback): recomputed
    assert float(norms.total([a, b])) == pytest.approx(float(torch.cat([a, b]).norm()))
    c = b.clone()
    kept = norms.total([a, b])
    assert norms.total([a, c]) is not kept and float(norms.total([a, c])) == 4.0  # another tensor, equal values
    assert float(norms.total([a])) == pytest.approx(12**0.5)


def test_a_module_that_clipped_in_a_fit_pickles(tmp_path: Path) -> None:
    """The kept norm held weakrefs of the step's gradients, which do not pickle: after a fit that clipped by norm,
    torch.save(module) and a Trainer(strategy="ddp_spawn") fit of it (which pickles the module to start the ranks)
    failed, ``TypeError: cannot pickle 'weakref.ReferenceType' object``. The copy has the weights and an empty cache."""
    import pickle

    module = tiny_lit()
    fit(module, tmp_path, steps=2, accumulate=1, gradient_clip_val=1.0)
    assert module._grad_norm._refs  # the last step's gradients, kept by weak reference
    copy = pickle.loads(pickle.dumps(module))
    assert copy._grad_norm._refs == [] and copy._grad_norm._norm is None and module._grad_norm._refs
    mine, ref = copy.state_dict(), module.state_dict()
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    a = torch.ones(4)
    assert float(copy._grad_norm.total([a])) == 2.0


@pytest.mark.parametrize("values, stops", [((1.5e19, 1.5e19), False), ((1.0, math.nan), True), ((math.inf, 1.0), True)])
def test_the_check_stops_on_nan_or_inf_gradients_only_not_on_a_total_norm_that_overflows(values, stops) -> None:
    """The check reads the total norm first; two finite gradients whose squares overflow only in its sum (inf) are no
    NaN/Inf gradient, as for the per-tensor test it replaced: the step goes on (Lightning's clip then scales them)."""
    module = tiny_lit()
    params = list(module.parameters())[:2]
    for p, v in zip(params, values):
        p.grad = torch.zeros_like(p)
        p.grad.view(-1)[0] = v
    module._trainer = SimpleNamespace(precision_plugin=SimpleNamespace(), callback_metrics={}, global_step=3)
    optimizer = SimpleNamespace(param_groups=[{"params": params}])
    assert not torch.isfinite(module._grad_norm.total([p.grad for p in params]))
    if stops:
        with pytest.raises(NonFiniteError, match="non-finite gradients at step 3"):
            module.on_before_optimizer_step(optimizer)
    else:
        module.on_before_optimizer_step(optimizer)


def test_the_own_clip_is_taken_only_where_lightnings_would_clip_by_norm_without_a_word() -> None:
    """LitLLM clips with its kept norm only where Lightning's path would end in ``clip_grad_norm_`` with nothing to
    refuse: another value than the Trainer's (Lightning raises: two values given) and a fused optimizer under a mixed
    precision (its grads are still scaled; Lightning refuses to clip them) go through Lightning's own path."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from lit_dtrain.module_grads import clips_by_norm_like_lightning

    def module(plugin):
        trainer = SimpleNamespace(gradient_clip_val=1.0, gradient_clip_algorithm="norm", precision_plugin=plugin)
        return SimpleNamespace(fabric=None, trainer=trainer)

    param = torch.nn.Parameter(torch.zeros(2))
    foreach, fused = torch.optim.AdamW([param], foreach=True), torch.optim.AdamW([param], fused=True)
    assert clips_by_norm_like_lightning(module(Precision()), foreach, 1.0, "norm")
    assert not clips_by_norm_like_lightning(module(Precision()), foreach, 0.5, "norm")
    bf16 = MixedPrecision("bf16-mixed", "cpu")
    assert clips_by_norm_like_lightning(module(bf16), foreach, 1.0, "norm")
    assert not clips_by_norm_like_lightning(module(bf16), fused, 1.0, "norm")
