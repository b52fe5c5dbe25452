"""A hook on the full checkpoint that Lightning's ``FSDPStrategy.load_checkpoint`` reads, before it loads the
optimizer states from it (lightning 2.6 private: the strategy module's ``_lazy_load``; no public hook runs between)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def transformed_on_read(transform: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Inside the block, each checkpoint Lightning's FSDP strategy reads whole is passed to ``transform`` (which
    changes it in place) before Lightning uses it."""
    import lightning.pytorch.strategies.fsdp as lightning_fsdp

    read = lightning_fsdp._lazy_load

    def read_and_transform(*args: Any, **kwargs: Any) -> Any:
        checkpoint = read(*args, **kwargs)
        transform(checkpoint)
        return checkpoint

    lightning_fsdp._lazy_load = read_and_transform
    try:
        yield
    finally:
        lightning_fsdp._lazy_load = read
