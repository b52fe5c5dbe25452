"""Random numbers of a training forward (dropout masks) as a function of the optimizer step, so that a resumed run
draws what the uninterrupted one drew.

A checkpoint holds no RNG state, and ``train.py`` seeds the generators once at start: with ``model.dropout > 0`` a
run resumed at step S drew other dropout masks for steps S.. than the straight run had (its weights were 0.0047 off
after 4 steps, a 3-block model stopped at 2), while a resumed run without dropout was bitwise the straight one. Data
draws are a function of the step (``LMDataModule``); now the forward's random draws are too: each micro-batch's forward
runs on generators seeded from (the run's seed, the global step, the micro-batch within the step, the rank), forked so
that nothing else in the process sees them. Checkpointed blocks replay those states in their recomputation.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch


def draws_random(model: torch.nn.Module) -> bool:
    """Whether ``model``'s training forward draws random numbers: a ``config.dropout`` above 0 (lit_dtrain's Llama)
    or an ``nn.Dropout`` with ``p > 0``. A model that draws none runs unforked (no generator state is read or set)."""
    if float(getattr(getattr(model, "config", None), "dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def step_seed(base_seed: int, step: int, micro_batch: int, rank: int) -> int:
    """A 63-bit seed for one micro-batch's forward; distinct across steps, micro-batches and ranks."""
    key = f"{base_seed}:{step}:{micro_batch}:{rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@contextlib.contextmanager
def forward_rng(seed: int, device: torch.device):
    """The CPU generator, and ``device``'s when it is not the CPU, seeded with ``seed`` inside; their states outside
    are what they were before."""
    accel = device.type not in ("cpu", "meta")
    index = (device.index if device.index is not None else torch.get_device_module(device.type).current_device()
             ) if accel else None
    with torch.random.fork_rng(devices=[index] if accel else [], device_type=device.type if accel else "cuda"):
        torch.random.default_generator.manual_seed(seed)
        if accel:  # (torch.manual_seed would also seed, unforked, every other device of the process)
            torch.get_device_module(device.type).default_generators[index].manual_seed(seed)
        yield
