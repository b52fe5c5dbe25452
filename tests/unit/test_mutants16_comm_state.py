"""``lit_dtrain.strategies._comm_state`` where the sixteenth hand mutation audit found its refusals unpinned: a resume
whose checkpoint and strategy disagree on having a per-step compressor or a local-update rule. Each of the two checks
in ``apply_comm_state`` backs the other up (a strategy has a compressor exactly when it has no local-update rule), so
either one removed alone still refuses; with neither, the load failed with ``AttributeError: 'NoneType' object has no
attribute 'get'`` deep in a codec, a traceback naming neither the file nor the way out. Real checkpoints, written by a
1-process fit under one strategy and resumed by a fit under the other. Also pinned: a kept sync's pseudo-gradient
codec residuals, the warning of a checkpoint without per-rank parameters, and the model's shapes handed to the
PowerSGD warm-start note."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_dtrain.errors import ConfigError
from lit_dtrain.strategies import CompressedDDPStrategy
from tests.toys import TinyRegression


def _fit(strategy: CompressedDDPStrategy, max_steps: int, ckpt_path=None) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        strategy=strategy)
    trainer.fit(TinyRegression(lr=0.05), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("written, resumed, preset", [
    ({"local_update": "local_sgd"}, {"compressor": "int8"}, "strategy=ddp_compressed/local_sgd"),
    ({"compressor": "int8"}, {"local_update": "local_sgd"}, "strategy=ddp_compressed/int8"),
    ({"local_update": "diloco"}, {"compressor": "none"}, "strategy=ddp_compressed/diloco"),
])
def test_a_resume_across_a_codec_and_a_local_update_rule_is_refused_naming_the_file(
    tmp_path, no_group_left, written, resumed, preset
):
    """Local SGD's checkpoint resumed under int8 (and the reverse; DiLoCo under no compression): a ConfigError that
    names the file, the preset that wrote it and ``strategy=ddp``, before any step; the module keeps the weights of
    its own start, nothing of the checkpoint's state half-applied (without both checks: AttributeError)."""
    path = tmp_path / "last.ckpt"
    first = _fit(CompressedDDPStrategy(**written), 2)
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        strategy=CompressedDDPStrategy(**resumed))
    module = TinyRegression(lr=0.05)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        trainer.fit(module, ckpt_path=path)
    message = str(err.value)
    local = "local_update" in written
    had = ("no per-step gradient codec and a local-update rule" if local
           else "a per-step gradient codec and no local-update rule")
    has = ("a per-step gradient codec and no local-update rule" if local
           else "no per-step gradient codec and a local-update rule")
    assert message.startswith(f"{path}: lit_dtrain_comm: the checkpoint was written with {had}; this strategy "
                              f"has {has} ("), message
    for part in (f"Resume it with the preset that wrote it ({preset})", "or with strategy=ddp,"):
        assert part in message, (part, message)
    assert trainer.global_step == 0
    assert not torch.equal(saved["net.weight"], start["net.weight"])  # the fit moved them: a load would show
    assert all(torch.equal(v, start[k]) for k, v in module.state_dict().items())


def test_a_kept_sync_gives_the_pseudo_gradient_codecs_residuals_from_before_it():
    """DiLoCo with an int4 error-feedback pseudo-gradient codec, its sync at step 4 done, a stop's sync kept at step
    6: the rank's codec state gathered is the one from before that sync (the step and schedule it goes with), not the
    residuals the sync left (which a resume would then count twice); the 2-rank fit is in tests/dist. Killed the
    mutant taking ``local_update_rank`` from the state of now."""
    from types import SimpleNamespace

    from lit_dtrain.strategies import CommSession, DiLoCo, LoopbackCommunicator
    from lit_dtrain.strategies._comm_state import gather_comm_state, kept_for_a_resume

    strategy = CompressedDDPStrategy(local_update=DiLoCo(sync_period=4, compressor="int4"))
    module = torch.nn.Linear(3, 2)
    module._trainer = SimpleNamespace(global_step=6)
    strategy._lightning_module, strategy.optimizers = module, [torch.optim.SGD(module.parameters(), lr=0.1)]
    rule, params = strategy.local_update, CommSession.named_params(module)
    rule.maybe_initialize(params)
    for step in range(6):
        with torch.no_grad():
            module.weight.add_(0.01 * (step + 1) * torch.arange(6.0).view(2, 3).sin())
        rule.after_optimizer_step(params, LoopbackCommunicator())
    before = {k: v.clone() for k, v in rule.rank_local_state_dict()["residuals"].items()}
    with kept_for_a_resume(strategy, 6):
        rule.sync_now(params, LoopbackCommunicator())
    after = rule.rank_local_state_dict()["residuals"]
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the sync moved them
    gathered = gather_comm_state(strategy)["per_rank"][0]["local_update"]["residuals"]
    assert gathered.keys() == before.keys()
    assert all(torch.equal(gathered[k], before[k]) for k in before)


def test_a_local_update_checkpoint_without_per_rank_parameters_resumes_from_rank_0s_and_says_so():
    """A local SGD state written before checkpoints held each rank's parameters and optimizer state: every rank
    resumes from rank 0's (Lightning's ``state_dict``), nothing of its own to restore, and a warning says so; the
    schedule is the saved one. Killed the mutant that dropped the warning."""
    from lit_dtrain.strategies._comm_state import apply_comm_state, gather_comm_state
    from tests.unit.test_mutants13_comm_state import _strategy_at

    state = gather_comm_state(_strategy_at(6))
    state["per_rank"] = [{k: v for k, v in entry.items() if k not in ("params", "optimizer_states")}
                         for entry in state["per_rank"]]
    strategy = _strategy_at(0)
    with pytest.warns(UserWarning, match=r"^lit_dtrain_comm: this checkpoint predates per-rank parameters; every "
                                         r"rank resumes from rank 0's parameters and optimizer state$"):
        apply_comm_state(strategy, state)
    assert strategy._rank_restore is None
    assert (strategy.local_update.step, strategy.local_update.steps_since_sync) == (6, 2)


def test_a_resume_at_a_higher_powersgd_rank_counts_the_qs_that_restart_by_the_models_shapes():
    """PowerSGD rank 2 resumed at rank 4 into a module with an (8, 8) and a (2, 6) matrix: the (6, 2) Q of the
    narrow one is what rank 4 starts from too, so 1 of the 2 Qs restarts; ``apply_comm_state`` must hand the module's
    shapes on (the Q alone cannot tell its matrix is 2 wide). Killed the mutant passing no shapes ('each Q
    restarts')."""
    from lit_dtrain.strategies._comm_state import apply_comm_state

    codec = {"name": "powersgd", "matrix_approximation_rank": 2, "min_compression_rate": 0.5}
    written = CompressedDDPStrategy(compressor=codec)
    written.compressor.q_memory = {"w": torch.randn(8, 2), "narrow": torch.randn(6, 2)}
    state = written.comm_state_dict()
    module = torch.nn.Module()
    module.w, module.narrow = torch.nn.Parameter(torch.zeros(8, 8)), torch.nn.Parameter(torch.zeros(2, 6))
    resumed = CompressedDDPStrategy(compressor={**codec, "matrix_approximation_rank": 4})
    resumed._lightning_module = module
    with pytest.warns(UserWarning, match=r"Qs \(2 matrices\) are of rank 2 and this run's strategy.compressor."
                                         r"matrix_approximation_rank is 4: 1 of them restart \(the other 1, of "
                                         r"matrices at most 2 wide, fit both ranks and are kept\) from random"):
        apply_comm_state(resumed, state)
