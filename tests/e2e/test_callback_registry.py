"""Every callback config in conf/callbacks/ goes through train and resume (Composer's registry test).

A new technique gets this coverage by adding its YAML file: the resumed run must equal the straight one
bitwise, so every piece of callback state is in the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from lit_dtrain.train import train
from tests.conftest import CONF_DIR

# Overrides a callback needs besides itself (e.g. the sampler it drives).
NEEDS = {
    "fourier_sampler": ["data/sampler=fourier"],
    "wsd": ["callbacks.wsd.total_steps=8", "callbacks.wsd.warmup_steps=1"],
}
NO_SCHEDULER = {"wsd"}  # the callback sets the LR itself (the CLI equivalent is '~scheduler')


def make_cfg(tiny_cfg, name, *overrides, run):
    cfg = tiny_cfg(*overrides, run=run)
    if name in NO_SCHEDULER:
        with open_dict(cfg):
            cfg.scheduler = None
    return cfg
SKIP = {"default", "none"}
CALLBACKS = sorted(p.stem for p in Path(CONF_DIR, "callbacks").glob("*.yaml") if p.stem not in SKIP)


@pytest.mark.slow
@pytest.mark.parametrize("name", CALLBACKS)
def test_callback_trains_and_resumes_exactly(name, tiny_cfg):
    horizon = [] if name == "wsd" else ["scheduler.total_steps=8"]
    common = [f"callbacks=[default,{name}]", *NEEDS.get(name, []), *horizon,
              "trainer.val_check_interval=2", "sample.max_new_tokens=0"]
    _, straight = train(make_cfg(tiny_cfg, name, *common, "trainer.max_steps=8", run=f"{name}_straight"))
    train(make_cfg(tiny_cfg, name, *common, "trainer.max_steps=4", run=f"{name}_split"))
    ckpt = Path(straight["trainer"].default_root_dir).parent / f"{name}_split" / "checkpoints" / "last.ckpt"
    _, resumed = train(make_cfg(tiny_cfg, name, *common, "trainer.max_steps=8", f"ckpt_path={ckpt}",
                                run=f"{name}_split"))
    a, b = straight["module"].model.state_dict(), resumed["module"].model.state_dict()
    assert resumed["trainer"].global_step == 8
    for k in a:
        assert torch.equal(a[k], b[k]), (name, k)


def test_callback_needing_token_loss_is_rejected_before_compute(tiny_cfg):
    from hydra.utils import instantiate

    from lit_dtrain.callbacks._contract import StepOutputError, check_step_outputs
    from lit_dtrain.module import LitLLM

    class LossOnly(LitLLM):
        step_output_keys = ("loss",)

    cfg = tiny_cfg()
    module = LossOnly(instantiate(cfg.model), instantiate(cfg.optimizer))
    needy = [type("NeedsTokenLoss", (), {"required_step_outputs": ("token_loss", "index")})()]
    match = "NeedsTokenLoss needs training_step to return \\['token_loss', 'index'\\]"
    with pytest.raises(StepOutputError, match=match):
        check_step_outputs(needy, module)
    check_step_outputs(needy, LitLLM(instantiate(cfg.model), instantiate(cfg.optimizer)))  # LitLLM satisfies it


def test_fourier_sampler_brings_its_callback(tiny_cfg):
    _, objs = train(tiny_cfg("data/sampler=fourier", "sample.max_new_tokens=0", run="fourier_auto"))
    names = [type(c).__name__ for c in objs["trainer"].callbacks]
    assert names.count("FourierSamplerCallback") == 1
