"""A strategy given by name (``strategy=auto``, or ``strategy.name=ddp``) built as lit_dtrain's class.

``strategy=auto`` (the default) hands Lightning the name ``auto``. On several processes (``trainer=ddp_cpu``, several
GPUs, ``trainer.num_nodes`` > 1, torchrun) Lightning chooses ``ddp`` (``ddp_fork`` in an interactive session) and
builds it from its strategy registry: its plain ``DDPStrategy``, without the epoch-length check of ``strategy=ddp``
(:class:`~lit_dtrain.strategies.fit_end.EpochLengthCheck`). While :func:`even_epochs_by_name` is active, every
registry name of Lightning's plain ``DDPStrategy`` or ``FSDPStrategy`` builds
:class:`~lit_dtrain.strategies.EvenEpochsDDPStrategy` or :class:`~lit_dtrain.strategies.EvenEpochsFSDPStrategy`
with that name's arguments (start method, ``find_unused_parameters``, CPU offload); Lightning's choice itself (which
name, its fallbacks) and every other name are unchanged, and so is the registry once it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, StrategyRegistry


@contextlib.contextmanager
def even_epochs_by_name() -> Iterator[None]:
    """Within: Lightning builds lit_dtrain's DDP / FSDP classes for the names of its plain ones (around a Trainer's
    construction, where Lightning resolves a strategy name)."""
    from lit_dtrain.strategies import EvenEpochsDDPStrategy, EvenEpochsFSDPStrategy

    ours = {DDPStrategy: EvenEpochsDDPStrategy, FSDPStrategy: EvenEpochsFSDPStrategy}
    saved = {name: entry for name, entry in StrategyRegistry.items() if entry["strategy"] in ours}
    try:
        for name, entry in saved.items():
            StrategyRegistry[name] = {**entry, "strategy": ours[entry["strategy"]]}
        yield
    finally:
        StrategyRegistry.update(saved)
