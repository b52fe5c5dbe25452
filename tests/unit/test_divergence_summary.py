"""module.check_finite=false without a spike monitor: a run whose loss goes NaN trains on to max_steps, as asked, but
its end says it diverged. It exited with val_loss null in summary.json, nothing else, and 'checkpoint' named a
last.ckpt that AtomicCheckpointIO never wrote with the NaN weights (the one on disk held step 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def test_a_run_that_went_nan_says_it_diverged_from_which_step_and_which_checkpoint_is_finite(tiny_cfg, caplog):
    from lit_dtrain.train import train

    common = ("trainer.val_check_interval=2", "sample.max_new_tokens=0", "module.check_finite=false")
    cfg = tiny_cfg(*common, "trainer.max_steps=6", "+callbacks.fault._target_=tests.faults.PoisonLossAtStep",
                   "+callbacks.fault.step=3")
    with caplog.at_level("WARNING", logger="lit_dtrain.train"):
        metrics, _ = train(cfg)
    last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2  # the saves at steps 4 and 6 were skipped
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    for result in (metrics, summary):
        assert result["diverged"] is True and result["first_nonfinite_step"] == 3
        assert result["checkpoint"] == str(last) and result["steps"] == 6
    assert summary["val_loss"] is None
    (line,) = [r.getMessage() for r in caplog.records if "DIVERGED" in r.getMessage()]
    assert line.startswith("the run DIVERGED from step 3 on (its training loss was the first NaN/inf): the final "
                           "weights are not finite (NaN/inf in "), line
    assert line.endswith(f"the newest finite one is {last} (step 2); summary.json says \"diverged\": true"), line
    # each skipped save of last.ckpt is warned once: the final save at step 6 repeated the validation's line
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"checkpoint '{last}' not written")]
    assert [m.split("the weights at step ")[1].split()[0] for m in skipped] == ["4", "6"], skipped


def test_a_healthy_run_says_it_did_not_diverge(tiny_cfg):
    from lit_dtrain.train import train

    cfg = tiny_cfg("trainer.max_steps=2", "sample.max_new_tokens=0")
    metrics, _ = train(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert summary["diverged"] is False and summary["first_nonfinite_step"] is None and metrics["diverged"] is False


def test_a_diverged_run_s_perplexity_is_exp_of_its_loss_not_capped(tmp_path, capsys):
    """A real run with optimizer.lr=1 module.check_finite=false ended at val_loss 68.3725 and reported ppl
    5184705528587072045056.00 (exp(50), the cap) in its summary line, summary.json and TensorBoard's val/ppl, as if
    measured: exp(68.37) is 4.9e29. The perplexity is exp(val_loss) now, inf (null in summary.json) past a float."""
    import functools
    import math
    from types import SimpleNamespace

    from lit_dtrain.models import build_llama
    from lit_dtrain.module import LitLLM, perplexity
    from lit_dtrain.optim import adamw
    from lit_dtrain.train import _report

    lit = LitLLM(build_llama(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16),
                 optimizer=functools.partial(adamw, lr=1e-2))
    logged = {}
    lit.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    lit.val_loss.update(torch.full((2, 4), 68.37), torch.ones(2, 4))
    lit.on_validation_epoch_end()
    assert float(logged["val/ppl"]) == pytest.approx(math.exp(68.37), rel=1e-5)
    assert perplexity(68.37) == math.exp(68.37) and perplexity(1000.0) == math.inf
    assert math.isnan(perplexity(float("nan")))
    for loss, shown, saved in ((68.3725, "ppl=4.94e+29 ", math.exp(68.3725)), (1865.1, "ppl=inf ", None),
                               (1.3887, "ppl=4.01 ", math.exp(1.3887))):
        metrics = {"val_loss": loss, "val_ppl": perplexity(loss), "steps": 8, "tokens_per_sec": 80.0,
                   "wall_seconds": 1.0, "checkpoint": None, "stopped": "max_steps"}
        _report(metrics, "", tmp_path, SimpleNamespace(loggers=[]))
        assert shown in capsys.readouterr().out
        assert json.loads((tmp_path / "summary.json").read_text())["val_ppl"] == saved
    # a very slow run (llama_125m on a CPU: 0.4 tokens/s) read 'tokens/s=0'
    for rate, shown in ((0.4, "tokens/s=0.4 "), (19432.5, "tokens/s=19432 "), (9.96, "tokens/s=10 ")):
        metrics = {"val_loss": 1.5, "val_ppl": perplexity(1.5), "steps": 8, "tokens_per_sec": rate,
                   "wall_seconds": 1.0, "checkpoint": None, "stopped": "max_steps"}
        _report(metrics, "", tmp_path, SimpleNamespace(loggers=[]))
        assert shown in capsys.readouterr().out


def _watch_run(watch, losses):
    """Feed ``losses`` (one per optimizer step; None: a skipped step) to ``watch`` as Lightning's hooks do."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(global_step=0)
    for step, loss in enumerate(losses):
        trainer.global_step = step
        watch.on_train_batch_start(trainer, None, None, 0)
        watch.on_train_batch_end(trainer, None, None if loss is None else {"loss": loss}, None, 0)


@pytest.mark.parametrize("fold_every", [1, 4, 64])
def test_the_loss_watch_names_the_first_non_finite_step_wherever_it_falls(fold_every):
    """NonFiniteLossWatch checks the losses a chunk at a time: the first NaN/inf step is the same before, on and after
    a chunk's edge, for a non-scalar loss with one inf element, after a skipped step, and when none was bad."""
    from lit_dtrain.divergence import NonFiniteLossWatch

    nan, inf = float("nan"), float("inf")
    for bad_at in [None, 0, 3, 4, 5, 63, 64, 70]:
        losses = [torch.tensor(2.0 - 0.01 * s) for s in range(72)]
        losses[1] = None
        if bad_at is not None:
            losses[bad_at] = torch.tensor(nan)
            losses[bad_at + 1] = torch.tensor([1.0, -inf])  # a later bad one does not move the first
        watch = NonFiniteLossWatch(fold_every=fold_every)
        _watch_run(watch, losses)
        assert watch.first_step == bad_at, (fold_every, bad_at)
    watch = NonFiniteLossWatch(fold_every=fold_every)
    _watch_run(watch, [torch.tensor(1.0), torch.tensor([[0.5, inf]], dtype=torch.float64)])
    assert watch.first_step == 1
    assert NonFiniteLossWatch(fold_every=fold_every).first_step is None  # no batch at all


def test_the_loss_watch_runs_no_tensor_op_per_batch_between_its_checks():
    """It checked every batch's loss on its own: detach, isfinite, all, not, lt, and, a new step tensor and where, 0.27
    ms of host time per step of a model=nano data.block_size=64 run (loaded 2-core machine). Between two checks of a
    chunk it keeps the detached loss only: no op but detach and views."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lit_dtrain.divergence import NonFiniteLossWatch

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    watch = NonFiniteLossWatch()  # checks 64 batches at a time
    losses = [torch.tensor(1.0 + s) for s in range(40)]
    _watch_run(watch, losses[:2])  # (the first batches, as any other)
    with Ops() as ops:
        _watch_run(watch, losses[2:])
    computing = [n for n in ops.names if n not in ("detach", "view", "alias", "_reshape_alias", "reshape")]
    assert computing == [], computing[:12]
    assert watch.first_step is None
