"""The names a codec or local-update rule is given by: ``strategy.compressor: int8``, ``{name: topk, ratio: 0.05}``.

:func:`build_compressor` and :func:`build_local_update` turn an instance (passed through), a name in
:data:`COMPRESSORS` / :data:`LOCAL_UPDATES`, or a mapping ``{"name": ..., **kwargs}`` into the object. Used by
:class:`~lit_dtrain.strategies.compressed_ddp.CompressedDDPStrategy`, by ``DiLoCo`` for its pseudo-gradient
compressor, and by the benchmark scripts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lit_dtrain.strategies.compressors import Compressor
from lit_dtrain.strategies.local_updates import DiLoCo, LocalSGD, LocalUpdate
from lit_dtrain.strategies.powersgd import PowerSGD
from lit_dtrain.strategies.quantize import BlockQuantizer, HalfPrecision, NoCompression
from lit_dtrain.strategies.sharded_quant import ShardedBlockQuantizer
from lit_dtrain.strategies.sparsify import ScaledSign, TopK

COMPRESSORS: dict[str, Callable[..., Compressor]] = {
    "none": NoCompression,
    "fp16": lambda **kw: HalfPrecision(dtype="fp16", **kw),
    "bf16": lambda **kw: HalfPrecision(dtype="bf16", **kw),
    "int8": lambda **kw: BlockQuantizer(bits=8, **kw),
    "int4": lambda **kw: BlockQuantizer(bits=4, **{"error_feedback": True, **kw}),  # as its preset and docs
    "int8_rs": lambda **kw: ShardedBlockQuantizer(bits=8, **kw),
    "int4_rs": lambda **kw: ShardedBlockQuantizer(bits=4, **{"error_feedback": True, **kw}),
    "powersgd": PowerSGD,
    "topk": TopK,
    "sign": ScaledSign,
}
LOCAL_UPDATES: dict[str, Callable[..., LocalUpdate]] = {
    "local_sgd": LocalSGD,
    "local_sgd_adaptive": lambda **kw: LocalSGD(adaptive=True, **kw),
    "diloco": DiLoCo,
}


def _build(spec: Any, registry: Mapping[str, Callable], base: type, what: str):
    if spec is None or isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"{what} must be a {base.__name__}, a name in {sorted(registry)} or a mapping with 'name', "
                         f"got {spec!r}")
    kwargs = dict(spec)
    name = kwargs.pop("name")
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(registry)}")
    return registry[name](**kwargs)


def build_compressor(spec: Compressor | str | Mapping | None) -> Compressor | None:
    """A compressor from an instance, a name (``"powersgd"``) or ``{"name": ..., **kwargs}``."""
    return _build(spec, COMPRESSORS, Compressor, "compressor")


def build_local_update(spec: LocalUpdate | str | Mapping | None) -> LocalUpdate | None:
    """A local-update rule from an instance, a name (``"diloco"``) or ``{"name": ..., **kwargs}``."""
    return _build(spec, LOCAL_UPDATES, LocalUpdate, "local_update")
