"""DDP strategies: compressed gradient all-reduce and local updates (importing this registers ``ddp_compressed``).

- :class:`CompressedDDPStrategy`: Lightning DDP with a compressor or local-update rule as its comm hook.
- Compressors (plain objects, no Lightning): :class:`NoCompression`, :class:`HalfPrecision` (fp16/bf16),
  :class:`BlockQuantizer` (int8/int4), :class:`ShardedBlockQuantizer`
  (int8/int4 through a quantized reduce-scatter), :class:`PowerSGD`, :class:`TopK`, :class:`ScaledSign`.
- Local updates: :class:`LocalSGD` (fixed or adaptive period), :class:`DiLoCo`.
- :func:`make_ddp`: Lightning's ``DDPStrategy`` with a timeout in seconds (``conf/strategy/ddp.yaml``).
- :func:`make_fsdp`: Lightning's ``FSDPStrategy`` wrapping the named module classes (``conf/strategy/fsdp.yaml``).

Both, like ``CompressedDDPStrategy``, refuse ranks whose training epochs differ in length at the epoch's first batch
(:class:`~lit_dtrain.strategies.fit_end.EpochLengthCheck`), and so does a strategy given by name (``strategy=auto`` on
several processes): :func:`~lit_dtrain.strategies.by_name.even_epochs_by_name`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from lit_dtrain.callbacks._args import check_arg
from lit_dtrain.config_keys import TIMEOUT_INSTEAD, refuse_unknown_keywords
from lit_dtrain.strategies._connect import DEFAULT_CONNECT_S, FirstConnection
from lit_dtrain.strategies._setup_refusals import SetupRefusalsShared
from lit_dtrain.strategies.comm import CommSession, Communicator, LoopbackCommunicator, compressed_comm_hook
from lit_dtrain.strategies.compressed_ddp import (
    CHECKPOINT_KEY,
    CompressedDDPStrategy,
    collective_timeout,
    dropped_comm_state_message,
    register_strategies,
    warn_if_comm_state_dropped,
)
from lit_dtrain.strategies.compressors import Compressor, Segment
from lit_dtrain.strategies.fit_end import EpochLengthCheck
from lit_dtrain.strategies.local_updates import DiLoCo, LocalSGD, LocalUpdate
from lit_dtrain.strategies.powersgd import PowerSGD
from lit_dtrain.strategies.quantize import BlockQuantizer, HalfPrecision, NoCompression
from lit_dtrain.strategies.registry import COMPRESSORS, LOCAL_UPDATES, build_compressor, build_local_update
from lit_dtrain.strategies.sharded_quant import ShardedBlockQuantizer
from lit_dtrain.strategies.sparsify import ScaledSign, TopK
from lit_dtrain.strategies.unused_params import advise_the_strategys_flag
from lit_dtrain.utils.distributed import RankFailureRecords


class EvenEpochsDDPStrategy(SetupRefusalsShared, RankFailureRecords, FirstConnection, EpochLengthCheck, DDPStrategy):
    """Lightning's ``DDPStrategy`` refusing ranks whose epochs differ in length (:class:`EpochLengthCheck`), whose
    first connection waits ``connect_timeout`` (:class:`~lit_dtrain.strategies._connect.FirstConnection`), and whose
    ranks name a rank that raised alone (:class:`~lit_dtrain.utils.distributed.RankFailureRecords`)."""

    def __init__(self, *args: Any, connect_timeout: timedelta | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connect_timeout = connect_timeout or self._connect_timeout

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # Lightning's advice for unused parameters named its plain DDPStrategy
        advise_the_strategys_flag(exception, "make_ddp", "strategy=ddp ",
                                  "which skips the check that the ranks' epochs are of one length")


class EvenEpochsFSDPStrategy(SetupRefusalsShared, RankFailureRecords, FirstConnection, EpochLengthCheck, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` refusing ranks whose epochs differ in length (:class:`EpochLengthCheck`), and a
    CPU accelerator when the Trainer is built; its first connection waits ``connect_timeout``
    (:class:`~lit_dtrain.strategies._connect.FirstConnection`).

    Lightning refuses FSDP without a GPU only for its own class (``type(strategy) is FSDPStrategy``), so this subclass
    got past the check on a CPU and failed in ``fit``, after the ranks had started, with torch's traceback
    (``RuntimeError: FSDP needs a non-CPU accelerator device``).
    """

    def __init__(self, *args: Any, connect_timeout: timedelta | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connect_timeout = connect_timeout or self._connect_timeout
        self._wrapped_root: Any = None  # the fit's root FSDP module, around the LightningModule

    def setup(self, trainer: Any) -> None:
        """Lightning's setup; a later stage of the same module (``train()``'s ``validate`` after ``fit``) gets the
        fit's root FSDP module back. Lightning wraps only a module whose blocks are not FSDP units yet, so it left the
        LightningModule unwrapped, its own parameters (the embeddings, the final norm) the fit's 1-D flat shards: on 2
        ranks ``train.py strategy=fsdp`` failed in its final validation, after training and saving ``last.ckpt``,
        with ``RuntimeError: 'weight' must be 2-D`` (Lightning #19015)."""
        root = self._wrapped_root
        if root is not None and self.model is root.module:
            self.model = root
        super().setup(trainer)
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(self.model, FullyShardedDataParallel):
            self._wrapped_root = self.model

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, a plain optimizer's state (a DDP checkpoint) renumbered first in the model's order, as
        Lightning reads it (:mod:`~lit_dtrain.strategies.fsdp_resume`)."""
        from lit_dtrain.strategies.fsdp_resume import renumber_in_model_order
        from lit_dtrain.utils.fsdp_load import transformed_on_read

        with transformed_on_read(lambda checkpoint: renumber_in_model_order(checkpoint, self.optimizers, self.model)):
            return super().load_checkpoint(checkpoint_path, weights_only)

    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:  # set by the Trainer's accelerator connector, at construction
        from lightning.pytorch.accelerators import CPUAccelerator

        if isinstance(accelerator, CPUAccelerator):
            from lit_dtrain.errors import ConfigError

            raise ConfigError(
                "FSDP (make_fsdp, strategy=fsdp) shards the model over GPUs, but this Trainer runs on the CPU: on a "
                "CPU use DDP (strategy=ddp; Trainer(strategy=make_ddp()) in Python), or run on GPUs")
        self._accelerator = accelerator


def make_ddp(collective_timeout_s: float = 1800, connect_timeout_s: float = DEFAULT_CONNECT_S,
             **kwargs: Any) -> DDPStrategy:
    """Lightning's ``DDPStrategy`` with its collective timeout given in seconds (Hydra cannot build a timedelta); the
    ranks' first connection waits ``connect_timeout_s`` (at least ``collective_timeout_s``)."""
    refuse_unknown_keywords(make_ddp, kwargs, "make_ddp", "Lightning's DDPStrategy or torch's DistributedDataParallel",
                            TIMEOUT_INSTEAD)
    return EvenEpochsDDPStrategy(timeout=collective_timeout(collective_timeout_s, "make_ddp"),
                                 connect_timeout=collective_timeout(connect_timeout_s, "make_ddp", "connect_timeout_s"),
                                 **kwargs)


def make_fsdp(wrap_modules: Sequence[str | type] = ("lit_dtrain.models.Block",), collective_timeout_s: float = 1800,
              connect_timeout_s: float = DEFAULT_CONNECT_S, **kwargs: Any) -> FSDPStrategy:
    """Lightning's ``FSDPStrategy`` sharding each module of the classes named in ``wrap_modules`` (dotted paths).

    Lightning turns a *set* of classes into torch's ``ModuleWrapPolicy``; from YAML Hydra hands over a ``ListConfig``,
    which ``FSDPStrategy`` took for a policy callable and failed with at setup ("'ListConfig' object is not callable").
    """
    if isinstance(wrap_modules, (str, type)):  # one class (a string was taken letter by letter: "Error loading 't'")
        wrap_modules = [wrap_modules]
    check_arg("make_fsdp", "wrap_modules", wrap_modules, lambda v: all(isinstance(m, (str, type)) for m in v),
              "module classes or dotted class paths")  # 3 was "'int' object is not iterable"; None 'None' a path
    if not wrap_modules:
        raise ValueError("make_fsdp: wrap_modules must name at least one module class, e.g. lit_dtrain.models.Block")
    refuse_unknown_keywords(make_fsdp, kwargs, "make_fsdp",
                            "Lightning's FSDPStrategy or torch's FullyShardedDataParallel",
                            {**TIMEOUT_INSTEAD, "auto_wrap_policy": "wrap_modules (module classes or dotted paths)"})
    classes = {m if isinstance(m, type) else _module_class(str(m)) for m in wrap_modules}
    timeout = collective_timeout(collective_timeout_s, "make_fsdp")
    connect = collective_timeout(connect_timeout_s, "make_fsdp", "connect_timeout_s")
    return EvenEpochsFSDPStrategy(auto_wrap_policy=classes, timeout=timeout, connect_timeout=connect, **kwargs)


def _module_class(path: str) -> type:
    """The class at the dotted ``path``; a one-line ConfigError otherwise (Hydra's ``get_class`` logged its error, then
    raised a 3-line ImportError)."""
    from hydra._internal.utils import _locate

    from lit_dtrain.errors import ConfigError

    try:
        found = _locate(path)
    except Exception as e:  # (ImportError, or a ValueError for an empty path)
        found = e
    if not isinstance(found, type):
        why = str(found).strip().splitlines()[-1] if isinstance(found, Exception) else f"a {type(found).__name__}"
        raise ConfigError(f"make_fsdp: wrap_modules entry {path!r} is not a class ({why}); give dotted class paths, "
                          "e.g. lit_dtrain.models.Block")
    return found


register_strategies()

__all__ = [
    "CHECKPOINT_KEY", "COMPRESSORS", "LOCAL_UPDATES", "BlockQuantizer", "CommSession", "Communicator",
    "CompressedDDPStrategy", "Compressor", "DiLoCo", "EpochLengthCheck", "EvenEpochsDDPStrategy",
    "EvenEpochsFSDPStrategy", "HalfPrecision", "LocalSGD", "LocalUpdate",
    "LoopbackCommunicator", "NoCompression", "PowerSGD", "ScaledSign", "Segment", "ShardedBlockQuantizer", "TopK",
    "build_compressor", "build_local_update", "compressed_comm_hook", "dropped_comm_state_message", "make_ddp",
    "make_fsdp",
    "register_strategies", "warn_if_comm_state_dropped",
]
