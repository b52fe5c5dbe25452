"""Selective activation checkpointing as a Lightning callback, for lit_dtrain's model and any other.

Policies (``policy=``):

* ``none``: no checkpointing (the callback only reports);
* ``full``: every block is recomputed in backward (non-reentrant ``torch.utils.checkpoint``);
* ``every_k``: every k-th block is (``every_k=2``: blocks 1, 3, 5, ...);
* ``selective``: op-level, through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``:
  the outputs of ``save_ops`` (default: matmuls and SDPA) are kept, norms, activations, RoPE and
  elementwise ops are recomputed (Korthikanti et al. 2022; torchtitan's ``op`` SAC);
* ``budget``: a per-block mix of ``full``/``selective``/``none`` chosen from a measured probe pass so
  that peak activation memory stays at or under ``memory_budget`` x that of ``none``.

It runs in ``Callback.setup``, which Lightning calls before ``configure_model`` and before the
strategy wraps the model in DDP/FSDP: checkpointing first, then compile, then data parallel, the
order torchtitan uses. Blocks are the model's ``blocks`` ModuleList, or ``module_pattern`` (a glob
over module paths such as ``model.layers.*``) for other people's models.

Method card -- memory: ``full`` keeps only block inputs; ``selective`` keeps matmul/attention outputs;
time: ``full`` recomputes the whole forward of the blocks, ``selective`` only cheap ops; gradients
are unchanged (recomputation is exact). See docs/activation_checkpointing.md for measured numbers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg, finite_number, whole_at_least
from lit_dtrain.callbacks._checkpoint_policies import (
    DEFAULT_SAVE_OPS,
    MODES,
    BlocksNotFound,
    CheckpointedForward,
    apply_checkpointing,
    compiled_inner,
    every_k_plan,
    find_blocks,
    remove_checkpointing,
    resolve_ops,
    set_plan,
    uniform_plan,
)
from lit_dtrain.callbacks._checkpoint_report import log_plan_scalars, plan_figures, plan_scalars
from lit_dtrain.callbacks._state_keys import note_stage, state_is_for_fit
from lit_dtrain.errors import ConfigError

log = logging.getLogger(__name__)

POLICIES = ("none", "full", "every_k", "selective", "budget")


def _sum_outputs(out) -> torch.Tensor:
    """A scalar surrogate loss: the sum of every floating tensor in ``out`` (any nesting)."""
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("SelectiveCheckpointing budget probe: example_input_array's forward returned no float tensor")
    return sum(t.float().sum() for t in leaves)


HALF_TRUE = ("bf16-true", "16-true")


@contextlib.contextmanager
def _uncompiled(root: nn.Module):
    """Every compiled submodule of ``root`` (``torch.compile(block)``, or ``torch.compile(model)`` holding the blocks)
    replaced by its ``_orig_mod`` while the budget probe runs: it runs eagerly, as LitLLM's (compiled in
    ``configure_model``, after ``setup``); through compiled code MemTracker's module hooks saw nothing inside it
    ("module Block did not run in step_fn")."""
    swapped = []
    for _, parent in list(root.named_modules()):
        for attr, child in list(parent._modules.items()):
            if child is not None and compiled_inner(child) is not child:
                parent._modules[attr] = compiled_inner(child)
                swapped.append((parent, attr, child))
    try:
        yield
    finally:
        for parent, attr, child in reversed(swapped):
            parent._modules[attr] = child


def _true_dtype(plugin) -> torch.dtype | None:
    """The half dtype the model trains in under ``bf16-true``/``16-true``, with or without FSDP (FSDP's plugin converts
    the module too: its probe ran in fp32, with fp32's ratios between modes); None for other precisions. (``64-true``
    is left to fp32: everything doubles there, and the ratios between modes measured the same to 4 digits.)"""
    if isinstance(plugin, HalfPrecision) or (isinstance(plugin, FSDPPrecision) and plugin.precision in HALF_TRUE):
        return plugin._desired_input_dtype
    return None


def _probe_autocast(trainer: Trainer, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast of the trainer's mixed precision on the probe's device (its forward keeps bf16/fp16 matmul
    outputs next to fp32 ones, which changes the ratios between modes; FSDP's plugin autocasts on CUDA only, and the
    probe runs before the strategy moves the model); bf16-true/16-true's default dtype; no-op for other precisions."""
    plugin = getattr(trainer, "precision_plugin", None)
    if _true_dtype(plugin) is not None:
        return plugin.forward_context()
    if not isinstance(plugin, (MixedPrecision, FSDPPrecision)) or plugin.precision not in ("bf16-mixed", "16-mixed"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)  # Lightning's own autocast arguments


@contextlib.contextmanager
def _in_training_dtype(trainer: Trainer, module: nn.Module):
    """Under bf16-true/16-true the model trains in that dtype, but Lightning converts it only after ``setup``, where
    the probe runs. A probe in fp32 does not give bf16's ratios between modes (the loss's fp32 logits do not halve):
    a plan measured at 0.291 of ``none`` kept 0.313 in bf16-true training, over a 0.3 budget. So the probe runs on
    the model cast to the training dtype, and every parameter and buffer then gets its own fp32 tensor back."""
    dtype = _true_dtype(getattr(trainer, "precision_plugin", None))
    if dtype is None:
        yield
        return
    kept = [(t, t.data, t.grad) for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    try:
        for t, data, _ in kept:
            t.grad = None  # a grad of the old dtype cannot sit on a tensor of the new one
            t.data = data.to(dtype)
        yield
    finally:
        for t, data, grad in kept:
            t.grad = None
            t.data = data
            t.grad = grad


class SelectiveCheckpointing(Callback):
    """Activation checkpointing of a model's blocks with a configurable policy.

    Args:
        policy: one of ``none | full | every_k | selective | budget``.
        every_k: for ``every_k``, checkpoint every k-th block.
        save_ops: for ``selective`` (and the selective blocks of ``budget``), the ops whose outputs are
            saved, as ``"aten.mm"`` or ``"aten.mm.default"`` strings. None: matmuls and SDPA.
        module_pattern: glob over module paths of the LightningModule naming the blocks, e.g.
            ``model.layers.*`` or ``model.transformer.*.layers.*``. None: the ``blocks`` ModuleList.
        memory_budget: for ``budget``, the fraction of no-checkpointing peak activation memory to stay under.
        probe_batch_size: for ``budget``, the batch size of the probe pass.
        probe_seq_len: for ``budget``, its sequence length (None: the datamodule's ``block_size``,
            else the model config's ``block_size``).
        max_replans: for ``budget``, how many times a plan measured over the budget is re-planned and measured
            again (0: the first plan measured is used, fitting or not).

    The probe input is the LightningModule's ``example_input_array`` if set (surrogate loss: the sum
    of the outputs), else random token ids for a model with ``config.vocab_size`` (next-token
    cross-entropy through ``pl_module(input_ids)``). Its forward runs under the trainer's mixed-precision
    autocast, if any, as training's does.
    """

    def __init__(
        self,
        policy: str = "selective",
        every_k: int = 2,
        save_ops: Sequence[str] | None = None,
        module_pattern: str | None = None,
        memory_budget: float = 0.5,
        probe_batch_size: int = 1,
        probe_seq_len: int | None = None,
        max_replans: int = 3,
    ) -> None:
        check_arg("SelectiveCheckpointing", "policy", policy, lambda v: v in POLICIES, f"one of {POLICIES}")
        # whatever the policy: both are kept (int(), float()), so under another policy every_k=None was a bare
        # "TypeError: int() argument must be ... not 'NoneType'", and every_k=2.5 was taken as 2 without a word
        check_arg("SelectiveCheckpointing", "every_k", every_k, whole_at_least(1), "an integer >= 1")
        check_arg("SelectiveCheckpointing", "memory_budget", memory_budget, finite_number(lambda v: 0.0 < v <= 1.0),
                  "in (0, 1]")
        check_arg("SelectiveCheckpointing", "probe_batch_size", probe_batch_size, whole_at_least(1),
                  "an integer >= 1")
        check_arg("SelectiveCheckpointing", "probe_seq_len", probe_seq_len, whole_at_least(1, none_ok=True),
                  "an integer >= 1 or None")
        check_arg("SelectiveCheckpointing", "max_replans", max_replans, whole_at_least(0), "an integer >= 0")
        # a string (save_ops=aten.mm on the command line) became a list of its characters: "entry 'a' is not ..."
        # and a number (save_ops=0) was "TypeError: 'int' object is not iterable" in Hydra's wrapper
        check_arg("SelectiveCheckpointing", "save_ops", save_ops,
                  lambda v: v is None or not isinstance(v, str) and all(isinstance(op, str) for op in v),
                  "a list of op names such as [aten.mm, aten.bmm] or None")
        # module_pattern=0: "AttributeError: 'int' object has no attribute 'split'" in setup, inside fit
        check_arg("SelectiveCheckpointing", "module_pattern", module_pattern, lambda v: v is None or isinstance(v, str),
                  "a glob over module paths such as 'model.layers.*', or None (the model's blocks)")
        self.policy = policy
        self.every_k = int(every_k)
        self.save_ops = list(DEFAULT_SAVE_OPS if save_ops is None else save_ops)
        resolve_ops(self.save_ops)  # fail now on a typo, not in the first backward
        self.module_pattern = module_pattern
        self.memory_budget = float(memory_budget)
        self.probe_batch_size = int(probe_batch_size)
        self.probe_seq_len = None if probe_seq_len is None else int(probe_seq_len)
        self.max_replans = int(max_replans)
        self.block_names: list[str] = []
        self.plan: list[str] = []
        self.wrappers: list[CheckpointedForward] = []
        self.budget_report: dict | None = None
        self._patched: LightningModule | None = None  # the module whose blocks are wrapped
        self._blocks: list[nn.Module] = []  # its blocks, wrapped from setup to teardown
        self._check_idle = False  # from train start until the first batch ends
        self._scalars: dict[str, float] = {}  # ckpt/*, from train start

    # ---- hooks --------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        note_stage(self, stage)
        # budget probes only for fit; a validate/test/predict setup that came first left the probe to it
        probe_due = stage == "fit" and self.policy == "budget" and self.budget_report is None
        if self.wrappers and self._patched is pl_module and not probe_due:  # setup runs again: the same wrappers
            for block, wrapper in zip(self._blocks, self.wrappers):  # back in (teardown took them out), same plan
                block.forward = wrapper
            return
        try:
            named = find_blocks(pl_module, self.module_pattern)
        except ConfigError as e:  # named under this callback; (a pattern that matched a container says so itself)
            hint = ""
            if isinstance(e, BlocksNotFound) and type(pl_module).configure_model is not LightningModule.configure_model:
                hint = (f". (If {type(pl_module).__name__}.configure_model builds the blocks, they do not exist yet "
                        "when this callback runs in setup.)")
            raise ConfigError(f"{type(self).__name__}: {e}{hint}") from e
        self.block_names = [n for n, _ in named]
        blocks = [compiled_inner(m) for _, m in named]
        self.wrappers = apply_checkpointing(blocks, uniform_plan(len(blocks), "none"), self.save_ops)
        self._patched, self._blocks = pl_module, blocks
        self.budget_report = None
        if self.policy == "budget" and stage != "fit":
            # without grad nothing is checkpointed: no probe (a forward + backward per mode) outside fit
            plan = uniform_plan(len(blocks), "none")
        elif self.policy == "budget":
            plan = self._budget_plan(trainer, pl_module, blocks)
        elif self.policy == "every_k":
            plan = every_k_plan(len(blocks), self.every_k)
            if "full" not in plan:
                raise ConfigError(f"SelectiveCheckpointing every_k={self.every_k} exceeds the {len(blocks)} blocks "
                                  f"found: nothing would be checkpointed; use every_k <= {len(blocks)}")
        elif self.policy == "none":
            plan = uniform_plan(len(blocks), "none")
        else:
            plan = uniform_plan(len(blocks), self.policy)
        self.plan = list(plan)
        set_plan(self.wrappers, self.plan)
        counts = {m: self.plan.count(m) for m in MODES if self.plan.count(m)}
        rank_zero_info(f"SelectiveCheckpointing(policy={self.policy}): {len(blocks)} blocks "
                       f"({self.block_names[0]} .. {self.block_names[-1]}), modes {counts}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # the blocks get their own forward back: kept, the wrappers went on checkpointing in a later fit without this
        # callback and in a plain forward with grad (policy=full, model=nano, batch 8: a second fit's step 1058 ms
        # against 752 ms never patched); setup puts the same wrappers back, plan and counts kept
        remove_checkpointing(self._blocks)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # a fit that raised never reaches teardown (Lightning tears down only the strategy): the blocks went on
        # checkpointing in the caller's next fit or forward with grad (an out-of-memory retry, a notebook)
        remove_checkpointing(self._blocks)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for w in self.wrappers:
            w.ran = False
        self._check_idle = True
        self._scalars = plan_scalars(self.plan_figures())  # the plan in use: a resume's is the checkpoint's by now

    def plan_figures(self) -> dict:
        """The plan in use, its block counts and (``budget``) the probe's figures of it: :func:`plan_figures`."""
        return plan_figures(self.policy, self.plan, self.budget_report)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        log_plan_scalars(trainer, pl_module, self._scalars)  # beside memory/*: the plan was in the log line only
        if not self._check_idle:
            return
        # a block in a checkpointing mode that training never called (matched by module_pattern but unused, or used
        # only through its weights) is checkpointed nowhere: say so once, naming it
        idle = [
            name
            for name, w in zip(self.block_names, self.wrappers)
            if w.mode != "none" and not w.ran
        ]
        self._check_idle = False
        if idle:
            rank_zero_warn(
                f"SelectiveCheckpointing(policy={self.policy}): {', '.join(idle)} did not run with grad in the first "
                f"training step, so nothing is checkpointed there (module_pattern={self.module_pattern!r}); "
                "match the modules the forward calls"
            )

    @override
    def state_dict(self) -> dict:
        return {"policy": self.policy, "plan": list(self.plan)}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        if not state_is_for_fit(self):
            return
        # A resumed ``budget`` run keeps the plan it trained with (the probe timings are noisy).
        saved = list(state_dict.get("plan", []))
        if state_dict.get("policy") == self.policy == "budget" and len(saved) != len(self.wrappers):
            # module_pattern or the model changed since the checkpoint: its plan cannot be mapped onto these blocks
            rank_zero_warn(f"SelectiveCheckpointing(policy=budget): the checkpoint's plan covers {len(saved)} blocks, "
                           f"this run checkpoints {len(self.wrappers)}; this run's probe plan {self.plan} is used")
        elif state_dict.get("policy") == self.policy == "budget":
            if self.plan and saved != self.plan:  # setup's probe logged another plan: say which one is used
                counts = {m: saved.count(m) for m in MODES if saved.count(m)}
                rank_zero_warn(f"SelectiveCheckpointing(policy=budget): resumed with the checkpoint's plan {saved} "
                               f"(modes {counts}); this run's probe plan {self.plan} (memory_budget="
                               f"{self.memory_budget}) is not used")
            self.plan = saved
            set_plan(self.wrappers, saved)

    # ---- budget -------------------------------------------------------------------------------------------
    def _probe_forward(self, trainer: Trainer, pl_module: LightningModule):
        if type(pl_module).forward is LightningModule.forward:  # (torch's "missing the required forward" named no fix)
            name = type(pl_module).__name__
            raise ConfigError(
                f"SelectiveCheckpointing(policy='budget') measures a probe pass by calling {name}(<probe input>), but "
                f"{name} defines no forward (its training_step calls its model itself); define one, e.g. "
                "def forward(self, idx): return self.model(idx), or use policy='full' or 'selective'"
            )
        device = next(pl_module.parameters()).device
        example = getattr(pl_module, "example_input_array", None)
        plugin = getattr(trainer, "precision_plugin", None)
        if example is not None and _true_dtype(plugin) is not None:
            example = plugin.convert_input(example)  # the model is in bf16/fp16 (_in_training_dtype), as in training
        if example is not None:

            def forward_fn():
                with _probe_autocast(trainer, device):
                    if isinstance(example, dict):
                        out = pl_module(**example)
                    elif isinstance(example, (tuple, list)):
                        out = pl_module(*example)
                    else:
                        out = pl_module(example)
                return _sum_outputs(out)

            return forward_fn
        configs = (getattr(m, "config", None) for m in pl_module.modules())
        config = next((c for c in configs if hasattr(c, "vocab_size")), None)
        if config is None:
            raise ValueError(
                "SelectiveCheckpointing(policy='budget') needs a probe input: set "
                f"{type(pl_module).__name__}.example_input_array, or use a model with config.vocab_size"
            )
        seq = self.probe_seq_len or getattr(getattr(trainer, "datamodule", None), "block_size", None)
        seq = int(seq or config.block_size)
        if seq > config.block_size:  # the probe's forward failed inside the model, naming no setting
            raise ConfigError(f"SelectiveCheckpointing probe_seq_len={seq} exceeds the model's block_size "
                              f"{config.block_size}; use probe_seq_len <= {config.block_size} (null: data.block_size)")
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (self.probe_batch_size, seq + 1), generator=gen).to(device)

        def forward_fn():
            with _probe_autocast(trainer, device):
                logits = pl_module(ids[:, :-1])
            return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())

        return forward_fn

    def _budget_plan(self, trainer: Trainer, pl_module: LightningModule, blocks: list[nn.Module]) -> list[str]:
        from lit_dtrain.callbacks._checkpoint_budget import budget_plan_from_probe, max_over_ranks

        several = getattr(trainer, "world_size", 1) > 1  # every rank plans from the ranks' largest figures
        with _in_training_dtype(trainer, pl_module), _uncompiled(pl_module):
            plan, report = budget_plan_from_probe(
                self._probe_forward(trainer, pl_module), pl_module, blocks, self.wrappers, self.memory_budget,
                self.save_ops, self.max_replans, max_over_ranks(trainer.strategy) if several else None,
            )
        # (the plans agree; rank 0's is still taken, so that all run the same graph whatever the float rounding)
        plan, report = trainer.strategy.broadcast((plan, report), src=0)
        self.budget_report = report
        if not report["fits"] and all(m == "full" for m in plan):
            rank_zero_warn(
                f"SelectiveCheckpointing: memory_budget={self.memory_budget} is below what checkpointing every "
                f"block reaches ({report['measured_ratio']:.3f} of no-checkpointing activation memory); "
                "using full checkpointing"
            )
        elif not report["fits"]:  # every re-plan still missed: the last plan measured is used
            rank_zero_warn(
                f"SelectiveCheckpointing: plan {plan} measured {report['measured_ratio']:.3f} of no-checkpointing "
                f"activation memory, over memory_budget={self.memory_budget}, after {len(report['tries'])} tries; "
                "it is used (a lower memory_budget asks for more checkpointing)"
            )
        rank_zero_info(f"SelectiveCheckpointing budget probe: measured {report['measured_ratio']:.3f} "
                       f"of no-checkpointing peak activation memory (budget {self.memory_budget}), plan {plan}")
        return list(plan)
