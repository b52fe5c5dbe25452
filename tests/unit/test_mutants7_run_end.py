"""A seventh hand mutation audit: ``step_rng``, ``module_metrics``, ``divergence``, ``stop_reason``, ``run_lock`` and
``end_sample`` pinned by exact results where a single-point mutant passed their test files (test_step_rng*.py,
test_predict.py, test_module.py, test_divergence_*.py, test_stop_reason*.py, test_run_lock*.py, test_end_sample*.py)."""

from __future__ import annotations

import torch

from lit_dtrain.step_rng import forward_rng, step_seed


def test_step_seeds_are_the_ones_earlier_runs_drew():
    """A run resumed under a newer lit_dtrain draws the dropout masks of the straight run only if (seed, step,
    micro-batch, rank) maps to the same seed: pinned, micro-batch and rank in their order (swapped, micro-batch 1 of
    rank 0 drew rank 1's masks of micro-batch 0)."""
    got = [step_seed(1337, 5, m, r) for m, r in ((0, 0), (1, 0), (0, 1), (2, 3))]
    assert got == [6192901580823910928, 15968781094485519, 2056896885981394245, 4229479781072050586]


def test_a_meta_device_forward_forks_the_cpu_generator_only():
    """A forward on the meta device (a model built there) seeds the CPU generator and puts it back; taken for an
    accelerator it asked for ``torch.meta`` (a RuntimeError: no such device module)."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with forward_rng(7, torch.device("meta")):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(7)
    assert torch.equal(inside, torch.rand(3))


def test_a_loss_whose_only_bad_element_is_minus_inf_is_the_first_non_finite_step():
    """A per-token loss with -inf among finite elements: its max alone (without abs) is finite, and the step was
    missed (the suite's -inf came after a NaN, its inf in a loss of its own)."""
    from lit_dtrain.divergence import NonFiniteLossWatch
    from tests.unit.test_divergence_summary import _watch_run

    for fold_every in (1, 64):
        watch = NonFiniteLossWatch(fold_every=fold_every)
        _watch_run(watch, [torch.tensor(1.0), torch.tensor([1.0, -float("inf")]), torch.tensor(0.5)])
        assert watch.first_step == 1, fold_every


def test_a_timer_at_exactly_max_time_is_the_max_time_stop():
    """Lightning's Timer stops where the training time reaches ``max_time`` (``elapsed >= duration``): 0 s left is a
    ``max_time`` stop, not ``should_stop`` (with ``< 0``); a second left is none."""
    from lightning.pytorch.callbacks import Timer

    from lit_dtrain.stop_reason import stop_reason
    from tests.unit.test_stop_reason import _trainer

    for elapsed, reason in ((4.0, "max_time"), (3.0, "should_stop"), (4.5, "max_time")):
        timer = Timer(duration="00:00:00:04")
        timer.load_state_dict({"time_elapsed": {"train": elapsed}})
        assert stop_reason(_trainer(callbacks=[timer])) == reason, elapsed


def test_a_lock_of_another_host_is_waited_for_no_longer_than_wait_s(tmp_path):
    """The wait for another host's lock ends at ``wait_s`` (each sleep cut to the time left): a sleep of its full 10 s
    step refused a 1-s wait after 10 s."""
    import time

    import pytest

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.run_lock import hold_run_dir
    from tests.unit.test_run_lock import _holder

    holder = _holder(tmp_path, "other-node")
    try:
        start = time.monotonic()
        with pytest.raises(ConfigError, match=r"is in use: process 1 on other-node"):
            hold_run_dir(tmp_path, wait_s=1.0)
        assert 1.0 <= time.monotonic() - start < 6.0
    finally:
        holder.kill()
        holder.wait()


def test_a_sample_config_without_temperature_or_top_k_draws_as_train_yaml_and_generate_py_default():
    """``generate_sample`` with only ``max_new_tokens`` (a project's own ``sample`` dict) samples at conf/train.yaml's
    and generate.py's defaults, temperature 0.8 and top-k 40: the same text as the full config's."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from lit_dtrain.data import ByteTokenizer
    from lit_dtrain.end_sample import generate_sample
    from tests.unit.test_kv_cache import tiny

    sample = OmegaConf.load(Path(__file__).parents[2] / "conf" / "train.yaml").sample
    assert (sample.temperature, sample.top_k) == (0.8, 40)
    tok, cpu = ByteTokenizer(), torch.device("cpu")
    # a spread model tells the temperatures apart, a near-flat one (init_std 0.02) top-k 40 from all 257 tokens
    for m, other in ((tiny(), {"temperature": 1.0}), (tiny(init_std=0.02), {"top_k": None})):
        full = generate_sample(m, tok, {"max_new_tokens": 12, "temperature": 0.8, "top_k": 40, "prompt": "ab"}, 3, cpu)
        assert generate_sample(m, tok, {"max_new_tokens": 12, "prompt": "ab"}, 3, cpu) == full
        assert generate_sample(m, tok, {"max_new_tokens": 12, "prompt": "ab", **other}, 3, cpu) != full, other
