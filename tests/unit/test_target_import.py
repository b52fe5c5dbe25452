"""A ``_target_`` that cannot be imported is refused with the config checks, in one line naming the key and the
target: it was Hydra's ERROR record, then its several-line 'Error locating target' after 'Seed set to 1337' (a
codec's when the strategy was built, later still)."""

import pytest

from lit_dtrain.errors import ConfigError


@pytest.mark.parametrize(("overrides", "line"), [
    (["+callbacks.x._target_=no.such.Cls"],
     "callbacks.x._target_='no.such.Cls' cannot be imported (ModuleNotFoundError: No module named 'no'): give the "
     "dotted path of a class or function"),
    (["trainer=ddp_cpu", "strategy=ddp_compressed", "strategy.compressor._target_=no.such.Cls"],
     "strategy.compressor._target_='no.such.Cls' cannot be imported (ModuleNotFoundError: No module named 'no'): give "
     "the dotted path of a class or function"),
    (["optimizer._target_=torch.optim.Adamw"],
     "optimizer._target_='torch.optim.Adamw' cannot be imported (module 'torch.optim' has no 'Adamw'); did you mean "
     "'torch.optim.AdamW'?"),
    (["callbacks=[default,loss_spike]", "callbacks.loss_spike._target_=lit_dtrain.callbacks.LossSpikeMonitr"],
     "callbacks.loss_spike._target_='lit_dtrain.callbacks.LossSpikeMonitr' cannot be imported (module "
     "'lit_dtrain.callbacks' has no 'LossSpikeMonitr'); did you mean 'lit_dtrain.callbacks.LossSpikeMonitor'?"),
])
def test_an_unimportable_target_is_one_line_before_the_seed(tiny_cfg, monkeypatch, caplog, overrides, line):
    import lightning as L

    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    with pytest.raises(ConfigError) as refused:
        train(tiny_cfg(*overrides))
    assert str(refused.value) == line
    assert not [r for r in caplog.records if r.name == "hydra.utils"]  # Hydra's own ERROR record of it: not given
