"""Ranks whose training epochs differ in length fail at the epoch's first batch, not at the collective timeout.

A DataLoader of one's own under ``use_distributed_sampler=False`` with 10 batches on rank 0 and 12 on rank 1
(``max_epochs=1``, local SGD period 4) hung until ``collective_timeout_s`` (rank 0 at step 9, rank 1 at step 11):
rank 0's last-step sync met rank 1's per-batch SIGTERM broadcast of Lightning. Under a per-step codec (``int8``) rank 0
exited 0 after 10 steps and rank 1 hung. The 2-rank fit is in ``tests/dist/test_compressed_ddp_fits.py``.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.strategies import fit_end
from lit_dtrain.strategies.fit_end import check_epoch_lengths, uneven_epochs_message


def test_uneven_epochs_name_each_ranks_batches_and_last_step():
    message = uneven_epochs_message([10, 12], batch_idx=0, global_step=0, max_steps=-1, accumulate=1)
    assert "(rank 0: 10 batches, its epoch ends after step 10; rank 1: 12 batches, its epoch ends after step 12)" in (
        message)
    assert "use_distributed_sampler=False" in message
    # the second epoch of a fit by epochs, 4 batches per step (the last step takes the epoch's 2 remaining batches)
    message = uneven_epochs_message([10, 12, 10], batch_idx=0, global_step=3, max_steps=-1, accumulate=4)
    assert "(ranks 0, 2: 10 batches, its epoch ends after step 6; rank 1: 12 batches, its epoch ends after step 6)" in (
        message)
    # resumed mid-epoch: 4 of the epoch's batches were run before (1 step), the step counter says 5
    message = uneven_epochs_message([10, 12], batch_idx=4, global_step=5, max_steps=-1, accumulate=4)
    assert "ends after step 7; rank 1: 12 batches, its epoch ends after step 7)" in message
    message = uneven_epochs_message([math.inf, 12], batch_idx=0, global_step=0, max_steps=-1, accumulate=1)
    assert "(rank 1: 12 batches, its epoch ends after step 12; rank 0: a loader without a length)" in message


@pytest.mark.parametrize("lengths, max_steps, error", [
    ([10, 10], -1, False),
    ([math.inf, math.inf], -1, False),  # no length: nothing is known ahead
    ([10, 12], 8, False),  # max_steps stops the fit before either epoch ends: nothing goes wrong
    ([10, 12], 10, False),  # the shorter epoch's last step is the fit's last on every rank too
    ([10, 12], 11, True),
    ([10, 12], -1, True),
    ([10, math.inf], 10, False),
    ([10, math.inf], 11, True),
])
def test_uneven_epochs_matter_only_when_a_rank_would_reach_its_epochs_end(lengths, max_steps, error):
    message = uneven_epochs_message(lengths, batch_idx=0, global_step=0, max_steps=max_steps, accumulate=1)
    assert (message is not None) == error


def test_under_accumulation_the_batches_count_not_the_steps():
    """10 and 12 batches, 4 a step: 3 steps on each rank, but rank 1 runs 2 batches more (each batch broadcasts
    Lightning's SIGTERM flag): only a max_steps met at a full step within the shorter epoch is safe."""
    assert uneven_epochs_message([10, 12], batch_idx=0, global_step=0, max_steps=2, accumulate=4) is None  # batch 8
    assert uneven_epochs_message([10, 12], batch_idx=0, global_step=0, max_steps=3, accumulate=4) is not None
    assert uneven_epochs_message([12, 14], batch_idx=4, global_step=7, max_steps=9, accumulate=4) is None  # batch 12
    assert uneven_epochs_message([12, 14], batch_idx=4, global_step=7, max_steps=10, accumulate=4) is not None


class _Strategy:
    """Stands for every rank: the all-gather returns this rank's length beside the others' (as given)."""

    root_device = torch.device("cpu")

    def __init__(self, others: list[float], monkeypatch) -> None:
        self.others, self.gathers = others, 0
        monkeypatch.setattr(fit_end, "_all_gather_number", self.gather)

    def gather(self, value: float, world_size: int, device) -> list[float]:
        self.gathers += 1
        assert world_size == 1 + len(self.others) and device == self.root_device
        return [value, *self.others]


def _trainer(num_training_batches: float, epoch: int = 0, world_size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(fit_loop=object(), current_epoch=epoch, world_size=world_size, global_step=0, max_steps=-1,
                           num_training_batches=num_training_batches, accumulate_grad_batches=1)


def test_the_check_gathers_once_an_epoch_and_raises_a_config_error(monkeypatch):
    strategy = _Strategy([12], monkeypatch)
    with pytest.raises(ConfigError, match=r"rank 0: 10 batches, .* rank 1: 12 batches, its epoch ends after step 12"):
        check_epoch_lengths(strategy, _trainer(10), batch_idx=0)
    strategy, trainer = _Strategy([10], monkeypatch), _trainer(10)
    for batch_idx in range(3):
        check_epoch_lengths(strategy, trainer, batch_idx)
    assert strategy.gathers == 1
    trainer.current_epoch = 1  # a loader reloaded each epoch may change length: asked again
    strategy.others = [9]
    with pytest.raises(ConfigError, match="rank 1: 9 batches"):
        check_epoch_lengths(strategy, trainer, batch_idx=0)
    assert strategy.gathers == 2
    single = _Strategy([], monkeypatch)
    check_epoch_lengths(single, _trainer(10, world_size=1), batch_idx=0)
    assert single.gathers == 0  # one rank: no collective


def test_plain_ddp_and_fsdp_run_the_same_check_at_each_batch(monkeypatch):
    """strategy=ddp (make_ddp) and strategy=fsdp (make_fsdp) check as CompressedDDPStrategy does: Lightning's own
    DDPStrategy let rank 0 of 10 and 12 batches exit 0 after 10 steps while rank 1 failed in its 11th all-reduce."""
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp, make_fsdp

    calls = []
    monkeypatch.setattr(fit_end, "check_epoch_lengths", lambda s, trainer, i: calls.append((s, trainer, i)))
    trainer = _trainer(10)
    for strategy in (make_ddp(), make_fsdp(), CompressedDDPStrategy()):
        strategy._lightning_module = SimpleNamespace(trainer=trainer)
        strategy.on_train_batch_start(None, 3)
        assert calls.pop() == (strategy, trainer, 3), type(strategy).__name__


def test_a_strategy_given_by_name_is_built_as_lit_dtrains_class_and_only_while_asked():
    """strategy=auto on several processes: Lightning chooses "ddp" and built its own DDPStrategy from its registry,
    without the check above (nor any other name of its plain DDP / FSDP). Under even_epochs_by_name each such name
    builds lit_dtrain's class with the name's arguments; the registry is Lightning's again after it, even after an
    error."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    from lit_dtrain.strategies import EvenEpochsDDPStrategy, EvenEpochsFSDPStrategy
    from lit_dtrain.strategies.by_name import even_epochs_by_name

    def built(strategy):
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False).strategy

    with even_epochs_by_name(60):
        auto = built("auto")
        assert type(auto) is EvenEpochsDDPStrategy and auto._start_method == "popen"
        assert auto._timeout.total_seconds() == 60
        spawn = built("ddp_spawn_find_unused_parameters_true")
        assert type(spawn) is EvenEpochsDDPStrategy and spawn._start_method == "spawn"
        assert spawn._ddp_kwargs == {"find_unused_parameters": True}
        assert StrategyRegistry["fsdp_cpu_offload"]["strategy"] is EvenEpochsFSDPStrategy
        offload = StrategyRegistry["fsdp_cpu_offload"]["init_params"]
        assert offload == {"cpu_offload": True, "timeout": timedelta(seconds=60),
                           "connect_timeout": timedelta(seconds=1800)}
        with pytest.raises(RuntimeError, match="inside"), even_epochs_by_name():
            raise RuntimeError("inside")
    assert type(built("auto")) is DDPStrategy  # Lightning's registry unchanged for others


def test_train_builds_the_checking_ddp_for_the_default_strategy_on_several_processes(tiny_cfg, monkeypatch):
    """`python train.py trainer=ddp_cpu` (strategy=auto, the README's DDP command) trained under Lightning's own
    DDPStrategy: a 2-rank run's rank 0 had no epoch-length check. It gets strategy=ddp's class now; a 4-step 2-rank
    run of each gave bitwise the same last.ckpt (weights and Adam state). strategy.collective_timeout_s, which a
    CollectiveError names, was Hydra's 'Could not override' under strategy=auto; it sets the timeout now.
    strategy.name=ddp_spawn ran fit in spawned ranks and exited 0 with summary.json's steps 0 and a last.ckpt at step 0
    without optimizer state (the trained weights only): it is refused before fit now."""
    import lit_dtrain.train as train_module
    from lit_dtrain.strategies import EvenEpochsDDPStrategy

    class Fit(Exception):
        pass

    def fit(trainer, *args):
        raise Fit(trainer.strategy)  # no processes started: which strategy the trainer holds is what is tested

    monkeypatch.setattr(train_module, "_fit", fit)
    with pytest.raises(Fit) as reached:
        train_module.train(tiny_cfg("trainer=ddp_cpu", "strategy.collective_timeout_s=90", "sample.max_new_tokens=0"))
    strategy = reached.value.args[0]
    assert type(strategy) is EvenEpochsDDPStrategy and strategy.world_size == 2
    assert strategy._timeout.total_seconds() == 90
    with pytest.raises(ConfigError, match=r"^strategy.collective_timeout_s must be a number of seconds > 0, got 0$"):
        train_module.train(tiny_cfg("trainer=ddp_cpu", "strategy.collective_timeout_s=0", run="zero"))
    with pytest.raises(ConfigError, match=r"^EvenEpochsDDPStrategy with start_method='spawn' runs fit in new processes "
                                          r"that return to this one without the step count"):
        train_module.train(tiny_cfg("trainer=ddp_cpu", "strategy.name=ddp_spawn", run="spawn"))


def test_a_misspelt_keyword_of_a_strategy_built_in_python_is_refused_when_it_is_built():
    """make_ddp(find_unused_parameter=True) was accepted, and both ranks failed in fit, after they had started, with
    DistributedDataParallel's TypeError 'got an unexpected keyword argument' (train.py refuses such a config key)."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp, make_fsdp

    refused = (r"^make_ddp: 'find_unused_parameter' is not an argument of make_ddp, nor of Lightning's DDPStrategy or "
               r"torch's DistributedDataParallel \(which take its other keywords\); did you mean "
               r"'find_unused_parameters'\?$")
    with pytest.raises(ConfigError, match=refused):
        make_ddp(find_unused_parameter=True)
    with pytest.raises(ConfigError, match=r"^make_fsdp: 'shardingstrategy' .*FullyShardedDataParallel.*'sharding_"):
        make_fsdp(shardingstrategy="FULL_SHARD")
    with pytest.raises(ConfigError, match=r"^CompressedDDPStrategy: 'compresor' .*did you mean 'compressor'\?$"):
        CompressedDDPStrategy(compresor="int8")
    assert make_ddp(find_unused_parameters=True, static_graph=True)._ddp_kwargs == {
        "find_unused_parameters": True, "static_graph": True}
    assert make_fsdp(cpu_offload=False, use_orig_params=True).kwargs["use_orig_params"] is True


def test_a_keyword_the_strategy_passes_its_wrapper_itself_is_refused_when_it_is_built():
    """make_ddp(device_ids=[0]), DistributedDataParallel's own keyword, passed the check, and a 2-rank
    'trainer=ddp_cpu strategy=ddp +strategy.device_ids=[0]' run failed in fit on both ranks with
    'DistributedDataParallel() got multiple values for keyword argument 'device_ids'' (Lightning passes the rank's
    device itself)."""
    from lit_dtrain.config_keys import check_target_keys
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp, make_fsdp

    leave_out = r"; Lightning's strategy passes {} itself \({}, to {}\): leave it out$"
    for build, key, what, wrapper in ((make_ddp, "device_ids", "the rank's device", "DistributedDataParallel"),
                                      (CompressedDDPStrategy, "module", "the model", "DistributedDataParallel"),
                                      (make_fsdp, "device_id", "the rank's device", "FullyShardedDataParallel")):
        with pytest.raises(ConfigError, match=rf"^{build.__name__}: '{key}' is not an argument {build.__name__} "
                                              rf"takes{leave_out.format(key, what, wrapper)}"):
            build(**{key: 0})
    node = OmegaConf.create({"_target_": "lit_dtrain.strategies.make_ddp", "device_ids": [0]})
    with pytest.raises(ConfigError, match=r"^strategy.device_ids is not an argument of lit_dtrain.strategies.make_ddp" +
                       leave_out.format("device_ids", "the rank's device", "DistributedDataParallel")):
        check_target_keys(node, "strategy", make_ddp)


def test_a_keyword_a_strategy_factory_sets_itself_names_the_argument_to_pass_instead():
    """make_fsdp(timeout=...) (a real 'strategy=fsdp +strategy.timeout=60' run) failed with Hydra's 'Error in call to
    target' block around 'EvenEpochsFSDPStrategy() got multiple values for keyword argument 'timeout'', as did
    auto_wrap_policy=; make_ddp named collective_timeout_s. Each says what to pass now."""
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp, make_fsdp

    for build, key, instead in ((make_fsdp, "timeout", "collective_timeout_s (seconds)"),
                                (make_fsdp, "auto_wrap_policy", "wrap_modules (module classes or dotted paths)"),
                                (make_ddp, "timeout", "collective_timeout_s (seconds)"),
                                (CompressedDDPStrategy, "timeout", "collective_timeout_s (seconds)")):
        with pytest.raises(ValueError, match=rf"^{build.__name__}: pass {re.escape(instead)} instead of {key}$"):
            build(**{key: 60})
