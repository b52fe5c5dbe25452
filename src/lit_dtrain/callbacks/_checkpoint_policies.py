"""Pure core of selective activation checkpointing (no Lightning imports).

* :func:`find_blocks` finds the transformer blocks: the model's ``blocks`` ModuleList, or a
  module-path glob such as ``model.layers.*`` for other people's models.
* :func:`apply_checkpointing` gives each block a switchable forward: ``none`` (plain), ``full``
  (non-reentrant ``torch.utils.checkpoint`` of the whole block) or ``selective`` (op-level: the
  outputs of the ops in ``save_ops`` are kept, everything else is recomputed in backward, through
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
* :func:`uniform_plan` / :func:`every_k_plan` are the block-level policies; :func:`plan_budget`
  chooses a per-block mix of ``full``/``selective``/``none`` from measured block profiles so that
  the estimated peak activation memory stays under a budget at the least recompute time.

The block's ``forward`` is replaced by an instance attribute rather than wrapping the block in a
``CheckpointWrapper`` module (torch.distributed.algorithms._checkpoint.checkpoint_wrapper, which
torchtitan uses): parameter names and ``state_dict`` keys stay unchanged, so checkpoints move
freely between runs with and without activation checkpointing, and the mode of a block can be
switched later (the budget probe and ``load_state_dict`` do that) without re-wrapping.
"""

from __future__ import annotations

import fnmatch
import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from lit_dtrain.callbacks._checkpoint_replay import eager_context_fn, with_buffers_replayed
from lit_dtrain.errors import ConfigError

MODES = ("none", "selective", "full")
"""What one block can do: keep everything, keep the outputs of ``save_ops``, keep only its inputs."""

DEFAULT_SAVE_OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
)
"""Matmul and attention outputs: costly to recompute, so ``selective`` saves them (torchtitan's
``_save_list`` also saves these; norms, activations, RoPE and elementwise ops are recomputed)."""


# ---- op list ----------------------------------------------------------------------------------------------
def resolve_ops(names: Sequence[str]) -> frozenset:
    """Turn ``"aten.mm"`` / ``"aten.mm.default"`` strings into torch op objects.

    A name without an overload (``aten.mm``) matches every overload of the op. Raises ``ValueError``
    naming the entry that is not an op, so a typo never silently saves nothing.
    """
    if isinstance(names, str):
        raise TypeError(f"save_ops must be a list of op names, got the string {names!r}")
    ops = set()
    for name in names:
        parts = str(name).split(".")
        if len(parts) not in (2, 3):
            raise ValueError(f"save_ops entry {name!r} is not 'namespace.op[.overload]' (e.g. 'aten.mm')")
        try:
            op = getattr(getattr(torch.ops, parts[0]), parts[1])
            if len(parts) == 3:
                op = getattr(op, parts[2])
        except (AttributeError, RuntimeError) as e:
            raise ValueError(f"save_ops entry {name!r} is not a known torch op: {e}") from e
        ops.add(op)
    return frozenset(ops)


class SaveOpsPolicy:
    """``create_selective_checkpoint_contexts`` policy: MUST_SAVE the listed ops, recompute the rest."""

    def __init__(self, ops: frozenset) -> None:
        self.ops = ops
        self._decisions: dict[int, CheckpointPolicy] = {}  # id(op) -> policy: called for every op, twice a step

    def saves(self, func) -> bool:
        """Whether the output of aten op ``func`` is kept in forward."""
        return func in self.ops or getattr(func, "overloadpacket", None) in self.ops

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        decision = self._decisions.get(id(func))
        if decision is None:  # op objects live as long as the process, so their ids are stable keys
            decision = CheckpointPolicy.MUST_SAVE if self.saves(func) else CheckpointPolicy.PREFER_RECOMPUTE
            self._decisions[id(func)] = decision
        return decision


def selective_context_fn(save_ops: Sequence[str] | None = None) -> Callable:
    """The ``context_fn`` for ``torch.utils.checkpoint`` that saves the outputs of ``save_ops``."""
    policy = SaveOpsPolicy(resolve_ops(DEFAULT_SAVE_OPS if save_ops is None else save_ops))
    return functools.partial(create_selective_checkpoint_contexts, policy)


# ---- block discovery --------------------------------------------------------------------------------------
def _modules_seen(root: nn.Module, max_depth: int = 3, limit: int = 60, lists_shown: int = 10) -> str:
    """The module paths down to ``max_depth`` dots, then every ``nn.ModuleList`` of modules with parameters (not
    LitLLM's metrics), at any depth, as a pattern with its length and first entry's class: the blocks of Lightning's
    demo Transformer (``model.transformer.encoder.layers.0``) or of a wrapped Hugging Face model
    (``model.model.layers.0``) lie below ``max_depth``, and the error listed neither them nor their list."""
    names = [n for n, _ in root.named_modules() if n and n.count(".") < max_depth]
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    lists = [f"{n}.* ({len(m)} x {type(m[0]).__name__})"
             for n, m in root.named_modules()
             if n and isinstance(m, nn.ModuleList) and len(m) and next(m[0].parameters(), None) is not None]
    if not lists:
        return shown
    more = f", ... ({len(lists) - lists_shown} more)" if len(lists) > lists_shown else ""
    return f"{shown}. Its nn.ModuleLists, as patterns: {', '.join(lists[:lists_shown])}{more}"


def _match(pattern: str, name: str) -> bool:
    """Glob match one dot-separated segment at a time, so ``model.layers.*`` matches ``model.layers.0``
    but not ``model.layers.0.attn``."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


class BlocksNotFound(ConfigError):
    """:func:`find_blocks` found no block (as opposed to a pattern that matched the wrong modules)."""


def find_blocks(root: nn.Module, module_pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks to checkpoint, as ``(module path, module)`` in forward order.

    With ``module_pattern=None`` the blocks are the children of the one ``nn.ModuleList`` named
    ``blocks`` under ``root`` (lit_dtrain's model contract). Otherwise every module whose dotted path
    matches the glob, segment by segment (``model.layers.*``, ``model.transformer.*.layers.*``).
    A module listed or registered more than once (weight sharing) is returned once, at its first path.
    Raises :class:`BlocksNotFound` (a ``ValueError``) naming the pattern and listing the modules seen when nothing
    matches, and ``ValueError`` when the pattern matches a container, which is never called.
    """
    if module_pattern is None:
        lists = [
            (n, m) for n, m in root.named_modules() if n.split(".")[-1] == "blocks" and isinstance(m, nn.ModuleList)
        ]
        if len(lists) != 1:
            found = "none" if not lists else ", ".join(n for n, _ in lists)
            raise (ValueError if lists else BlocksNotFound)(
                f"expected exactly one nn.ModuleList named 'blocks' in {type(root).__name__} (found: {found}); "
                f"pass module_pattern (a glob over module paths, e.g. 'model.layers.*'). "
                f"Modules seen: {_modules_seen(root)}"
            )
        prefix, blocks = lists[0][0], {}
        for i, m in enumerate(lists[0][1]):
            # a block listed more than once (weight sharing) has one forward, hence one mode: it is one block, named
            # by its first entry (named_modules does the same for module_pattern)
            blocks.setdefault(id(m), (f"{prefix}.{i}", m))
        return list(blocks.values())
    matches = [(n, m) for n, m in root.named_modules() if n and _match(module_pattern, n)]
    if not matches:
        raise BlocksNotFound(
            f"module_pattern {module_pattern!r} matched no module of {type(root).__name__}. "
            f"Modules seen: {_modules_seen(root)}"
        )
    containers = [n for n, m in matches if type(m).forward is nn.Module.forward]
    if containers:  # a ModuleList/ModuleDict is never called: wrapping it would checkpoint nothing
        raise ConfigError(
            f"module_pattern {module_pattern!r} matched {', '.join(containers)}, which has no forward of its own "
            f"(a container such as nn.ModuleList is never called); match its children, e.g. '{containers[0]}.*'"
        )
    return matches


def compiled_inner(block: nn.Module) -> nn.Module:
    """The module whose forward to patch for ``block``: a block compiled on its own (``torch.compile(block)``, an
    ``OptimizedModule``) calls its ``_orig_mod``, so the checkpoint goes inside the compiled region (checkpointing,
    then compile). Patched outside it, ``selective`` under inductor failed in backward with torch's "Tensor cached
    during selective activation checkpoint has been mutated", and the ``budget`` probe with "module OptimizedModule
    did not run in step_fn"."""
    inner = getattr(block, "_orig_mod", None)
    return inner if isinstance(block, torch._dynamo.eval_frame.OptimizedModule) and isinstance(inner, nn.Module) \
        else block


# ---- applying a plan --------------------------------------------------------------------------------------
class CheckpointedForward:
    """The ``forward`` a checkpointed block gets: its mode can be switched at any time.

    ``mode`` is one of :data:`MODES`. Without grad (validation, generation) the block runs plainly.
    ``calls`` counts the checkpointed calls that ran eagerly (tests use it as proof that checkpointing ran);
    ``ran`` is set by every checkpointed call, compiled or not, and reset by its owner.
    """

    def __init__(self, module: nn.Module, mode: str, context_fn: Callable) -> None:
        if mode not in MODES:
            raise ValueError(f"checkpoint mode must be one of {MODES}, got {mode!r}")
        self.inner = module.forward  # the block's own (bound) forward
        self.buffers = module.buffers
        self.mode = mode
        self.context_fn = context_fn
        self.calls = 0
        self.ran = False

    def __getstate__(self) -> dict:
        """A patched block pickles whole (``torch.save(model)``): the save list goes as op names (torch's op objects
        are not picklable), and the block's forward as its function, bound again on load (pickle rebuilt a bound
        method as ``getattr(block, "forward")``: this wrapper itself)."""
        state = dict(self.__dict__)
        inner, block = state.pop("inner"), state.pop("buffers").__self__
        bound = isinstance(inner, types.MethodType) and inner.__self__ is block
        state.update(block=block, inner=inner.__func__ if bound else inner, bound=bound,
                     context_fn=sorted(str(op) for op in self.context_fn.args[0].ops))
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        block, inner, bound = state.pop("block"), state.pop("inner"), state.pop("bound")
        self.__dict__.update(state)
        self.inner = types.MethodType(inner, block) if bound else inner
        self.buffers = block.buffers
        self.context_fn = selective_context_fn(state["context_fn"])

    def __call__(self, *args, **kwargs):
        if self.mode == "none" or not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        # Under torch.compile only a store: dynamo guards on the attributes the code reads, so `calls += 1`
        # there recompiled the model every step until the recompile limit, and then it ran eagerly.
        compiling = torch.compiler.is_compiling()
        self.ran = True
        if not compiling:
            self.calls += 1
        fn = self.inner
        if kwargs:
            # Keywords reach checkpoint positionally: it keeps some for itself (a block's `debug=True`), and takes the
            # device RNG states to replay only from positional tensors (`layer(hidden_states=x)` on a GPU: other
            # dropout masks in recomputation).
            fn, args = _KeywordsAsPositions(self.inner, len(args), tuple(kwargs)), (*args, *kwargs.values())
        if compiling:
            if self.mode == "full":  # no context_fn argument: torch.compile cannot trace a passed-in no-op one
                return checkpoint(fn, *args, use_reentrant=False)
            return checkpoint(fn, *args, use_reentrant=False, context_fn=self.context_fn)
        block = type(self.buffers.__self__).__name__
        context_fn = eager_context_fn(self.context_fn, block) if self.mode == "selective" else noop_context_fn
        buffers = list(self.buffers())
        if buffers:  # recomputation must see the buffers as forward did, and not update them a second time
            context_fn = with_buffers_replayed(buffers, context_fn)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


class _KeywordsAsPositions:
    """Calls ``fn`` with its trailing positional arguments given back as the keywords ``names``."""

    def __init__(self, fn: Callable, n_args: int, names: tuple[str, ...]) -> None:
        self.fn, self.n_args, self.names = fn, n_args, names

    def __call__(self, *args):
        return self.fn(*args[: self.n_args], **dict(zip(self.names, args[self.n_args :])))


def apply_checkpointing(
    blocks: Sequence[nn.Module], plan: Sequence[str], save_ops: Sequence[str] | None = None
) -> list[CheckpointedForward]:
    """Give every block a :class:`CheckpointedForward` in the mode ``plan[i]``; returns them.

    Re-applying to an already patched block only updates its mode and op list.
    """
    if len(plan) != len(blocks):
        raise ValueError(f"plan has {len(plan)} entries for {len(blocks)} blocks")
    context_fn = selective_context_fn(save_ops)
    wrappers = []
    for block, mode in zip(blocks, plan):
        current = block.__dict__.get("forward")
        if isinstance(current, CheckpointedForward):
            if mode not in MODES:
                raise ValueError(f"checkpoint mode must be one of {MODES}, got {mode!r}")
            current.mode, current.context_fn = mode, context_fn
            wrappers.append(current)
        else:
            wrapper = CheckpointedForward(block, mode, context_fn)
            block.forward = wrapper  # instance attribute: nn.Module.__call__ calls it
            wrappers.append(wrapper)
    return wrappers


def remove_checkpointing(blocks: Sequence[nn.Module]) -> None:
    """Undo :func:`apply_checkpointing`: blocks get their class ``forward`` back."""
    for block in blocks:
        if isinstance(block.__dict__.get("forward"), CheckpointedForward):
            del block.forward


def set_plan(wrappers: Sequence[CheckpointedForward], plan: Sequence[str]) -> None:
    """Switch the modes of already applied wrappers."""
    if len(plan) != len(wrappers):
        raise ValueError(f"plan has {len(plan)} entries for {len(wrappers)} blocks")
    for wrapper, mode in zip(wrappers, plan):
        if mode not in MODES:
            raise ValueError(f"checkpoint mode must be one of {MODES}, got {mode!r}")
        wrapper.mode = mode


# ---- block-level policies ---------------------------------------------------------------------------------
def uniform_plan(n_blocks: int, mode: str) -> list[str]:
    """Every block in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return [mode] * n_blocks


def every_k_plan(n_blocks: int, every_k: int) -> list[str]:
    """``full`` on every k-th block (blocks k-1, 2k-1, ...: torchtitan's ``ac_freq`` counting)."""
    if int(every_k) < 1:
        raise ValueError(f"every_k must be >= 1, got {every_k}")
    return ["full" if (i + 1) % int(every_k) == 0 else "none" for i in range(n_blocks)]


# ---- memory-budget policy ---------------------------------------------------------------------------------
@dataclass
class BlockProfile:
    """What one block keeps alive after its forward (bytes) and costs to recompute (seconds), per mode."""

    retained: dict[str, float]
    recompute: dict[str, float] = field(default_factory=lambda: {"none": 0.0, "selective": 0.0, "full": 0.0})
    calls: int = 1  # forward calls per step (a shared block: ``retained`` sums them, each is recomputed alone)


def estimate_peak(profiles: Sequence[BlockProfile], plan: Sequence[str], base: float) -> float:
    """Estimated peak activation bytes of ``plan``.

    After the forward every block holds ``retained[mode]``. In backward, block i is recomputed while
    blocks before it still hold theirs, so its full (``none``) activations come back on top of them.
    A block called several times per step is recomputed one call at a time, its earlier calls still holding
    theirs (before, all its calls' activations were counted back at once: 0.65 of ``none`` estimated for a plan
    measured at 0.21, so budgets it met were planned with needless recomputation).
    ``base`` is what lives outside the blocks (embeddings, logits, loss).
    """
    held = [p.retained[m] for p, m in zip(profiles, plan)]
    peak, before = sum(held), 0.0
    for p, m, h in zip(profiles, plan, held):
        if m != "none":
            peak = max(peak, before + h * (p.calls - 1) / p.calls + p.retained["none"] / p.calls)
        before += h
    return base + peak


def plan_budget(profiles: Sequence[BlockProfile], base: float, budget_bytes: float) -> tuple[list[str], float]:
    """Cheapest plan whose estimated peak is at most ``budget_bytes``; returns ``(plan, estimate)``.

    Plans are ``full`` on the first blocks, ``selective`` on the next, ``none`` on the last: early
    blocks are recomputed late in backward, when later blocks have already freed their activations,
    so their recompute does not raise the peak. All ``(n_full, n_selective)`` pairs are tried
    (exact within that family); ties in recompute time go to the plan that uses more of the budget.
    If even all-``full`` misses the budget, all-``full`` is returned (the caller warns).
    """
    n = len(profiles)
    best: tuple[float, float, list[str]] | None = None
    for n_full in range(n + 1):
        for n_sel in range(n - n_full + 1):
            plan = ["full"] * n_full + ["selective"] * n_sel + ["none"] * (n - n_full - n_sel)
            est = estimate_peak(profiles, plan, base)
            if est > budget_bytes:
                continue
            cost = sum(p.recompute[m] for p, m in zip(profiles, plan))
            key = (cost, -est)
            if best is None or key < best[:2]:
                best = (cost, -est, plan)
    if best is None:
        plan = ["full"] * n
        return plan, estimate_peak(profiles, plan, base)
    return best[2], -best[1]
