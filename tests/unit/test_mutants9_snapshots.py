"""Exact results of ``callbacks/_snapshots.py``'s capture and restore, on a plain module and optimizer (ninth hand
mutation audit): single-point mutants passed test_mutants5_snapshots.py, test_rollback_weight_averaging.py and the
loss-spike tests. A snapshot restored twice (a second spike rolled back to the same snapshot) restores its own
numbers both times, which an optimizer state loaded without a copy broke (Adam's in-place moment updates wrote into the
snapshot); the schedule's entries (``lr``, ``betas``) and those a group gained since (SWA's ``swa_lr``) stay, the
others come from the snapshot; the GradScaler's scale comes back; the layout counts each group's parameters; the copy
keeps tuples tuples."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lit_dtrain.callbacks._snapshots import capture, layout, restore


def _trainer(scaler=None):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.Adam([{"params": module[0].parameters()}, {"params": module[1].weight}], lr=0.1)
    return SimpleNamespace(lightning_module=module, optimizers=[optimizer], global_step=0, callbacks=[],
                           precision_plugin=SimpleNamespace(scaler=scaler), strategy=SimpleNamespace())


def _steps(trainer, n):
    for _ in range(n):
        trainer.optimizers[0].zero_grad()
        trainer.lightning_module(torch.randn(4, 3)).square().sum().backward()
        trainer.optimizers[0].step()
        trainer.global_step += 1


def _numbers(trainer):
    """The module's weights and every optimizer state tensor, cloned."""
    state = trainer.optimizers[0].state_dict()["state"]
    tensors = [t for p in state.values() for t in p.values() if torch.is_tensor(t)]
    return [t.detach().clone() for t in [*trainer.lightning_module.state_dict().values(), *tensors]]


def test_a_snapshot_restored_twice_restores_its_own_numbers_both_times():
    trainer = _trainer()
    _steps(trainer, 2)
    snap, expected = capture(trainer), _numbers(trainer)
    for _ in range(2):
        _steps(trainer, 3)
        restore(trainer, snap)
        assert all(torch.equal(a, b) for a, b in zip(_numbers(trainer), expected, strict=True))


def test_entries_gained_since_the_snapshot_stay_and_the_others_come_from_it():
    trainer = _trainer()
    group = trainer.optimizers[0].param_groups[0]
    group["d"] = 1.0  # an optimizer's learned entry (Prodigy's d)
    snap = capture(trainer)
    # d learned on; the schedule's LR and beta1 (OneCycleLR's cycle_momentum); SWALR's entry, added after
    group.update(d=2.0, lr=0.05, betas=(0.888, 0.999), swa_lr=0.01)
    restore(trainer, snap)
    group = trainer.optimizers[0].param_groups[0]
    assert (group["d"], group["lr"], group["betas"], group["swa_lr"]) == (1.0, 0.05, (0.888, 0.999), 0.01)


def test_the_grad_scalers_scale_comes_back():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # (its scale tensor is made lazily, at the first scale)
    trainer = _trainer(scaler)
    snap = capture(trainer)
    scaler.update(new_scale=2.0)
    restore(trainer, snap)
    assert scaler.get_scale() == 1024.0


def test_the_layout_counts_each_groups_parameters():
    trainer = _trainer()
    assert layout(trainer)[0] == [[2, 1]]  # Linear(3, 2)'s weight and bias, then the second's weight
    assert layout(trainer)[1] == ("0.weight", "0.bias", "1.weight", "1.bias")


def test_to_cpu_copies_with_each_containers_type():
    """A deep copy: tuples stay tuples (Adam's ``betas``, torch Adafactor's ``eps``), tensors are new storage."""
    from lit_dtrain.callbacks._snapshots import to_cpu

    t = torch.ones(2)
    copied = to_cpu({"betas": (0.9, 0.95), "eps": (None, 1e-3), "state": [t]})
    assert copied["betas"] == (0.9, 0.95) and copied["eps"] == (None, 1e-3)
    assert type(copied["betas"]) is tuple and type(copied["eps"]) is tuple and type(copied["state"]) is list
    assert torch.equal(copied["state"][0], t) and copied["state"][0].data_ptr() != t.data_ptr()
