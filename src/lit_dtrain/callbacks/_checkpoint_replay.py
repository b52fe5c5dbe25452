"""What eager recomputation of a checkpointed block must replay besides its ops: the random number generators'
states after saved random ops, and the block's buffers. (Under ``torch.compile`` the compiled graph handles both:
it saves random ops' outputs and functionalizes buffer updates.)"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


class _RandomOpsSaved:
    """The policy of one eager checkpointed call: ``policy``'s decisions, and after each saved random op the state of
    the random number generators it drew from, for :class:`_ReplayRngStates`.

    Recomputation replays a block's random ops from checkpoint's restored RNG state, but an op whose output is saved
    is not run again, so it draws nothing there, and every random op after it got other numbers than in forward. On
    a GPU, SDPA with ``dropout_p > 0`` is such an op (the flash/efficient/cuDNN kernels draw their mask and are saved
    by default), and the residual dropout after it then recomputed another mask than forward had applied: gradients
    silently wrong. torch 2.13 asks the policy after the op ran (``ctx.op_output``), earlier versions before it;
    there the state after the op is read when the next op is asked about.

    A saved output that a later op of the forward writes into in place is refused there (:meth:`_check_writes`).
    """

    def __init__(self, policy: Callable, block: str = "the block") -> None:
        self.policy, self.block = policy, block
        self.saved: dict[int, object] = {}  # storage address of a saved op's output -> that op (torch >= 2.13)
        self.after: list[tuple[object, list[tuple[torch.Generator, torch.Tensor]]]] = []  # (op, [(generator, state)])
        self.pending: tuple[object, list[torch.Generator]] | None = None  # a saved random op that has not run yet
        self.start: list[tuple[torch.Generator, torch.Tensor]] = []  # the generators' states as the forward began

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if ctx.is_recompute:  # (torch < 2.13 asks in recomputation too)
            return self.policy(ctx, func, *args, **kwargs)
        if self.pending is not None:
            self._record(*self.pending)
            self.pending = None
        decision = self.policy(ctx, func, *args, **kwargs)
        saves = decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
        if saves and hasattr(ctx, "op_output"):
            self.saved.update((ptr, func) for ptr in _storages(ctx.op_output))
        elif self.saved and func._schema.is_mutable:
            self._check_writes(func, args, kwargs)
        if saves and \
                torch.Tag.nondeterministic_seeded in func.tags:
            gens = _generators(tree_leaves((args, kwargs)))
            if hasattr(ctx, "op_output"):
                self._record(func, gens)
            else:
                self.pending = (func, gens)
        return decision

    def _check_writes(self, func, args: tuple, kwargs: dict) -> None:
        """Refuse an in-place op of the forward that wrote into a saved op's output: the cache keeps that tensor, not
        a copy, so backward read the changed value, and torch's own check (the version counter) does not see a write
        through views that do not share it. nn.GRU/nn.GRUCell on a CPU run ``sigmoid_``/``tanh_``/``add_`` on
        ``unsafe_split`` views of their saved ``addmm``: gradients 17-29% off, no error (nn.RNN, nn.LSTMCell: torch's
        'Tensor cached during selective activation checkpoint has been mutated' in backward, naming no op)."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for ptr in _storages(value):
                if ptr in self.saved:
                    from lit_dtrain.errors import ConfigError

                    raise ConfigError(
                        f"SelectiveCheckpointing: in the forward of a {self.block} block, {func} writes in place "
                        f"into the output of {self.saved[ptr]}, which the selective policy saves, so backward would "
                        f"read the changed value and the gradients would be wrong; checkpoint the {self.block} blocks "
                        f"with policy='full' or leave them out of module_pattern, or leave {self.saved[ptr]} out of "
                        "save_ops")

    def _record(self, func, gens: list[torch.Generator]) -> None:
        self.after.append((func, [(gen, gen.get_state()) for gen in gens]))

    def begin(self) -> None:
        """Read the states of the CPU generator and of the current CUDA device's (where CUDA is initialized) as the
        forward begins, for :meth:`drew`."""
        gens = [torch.random.default_generator]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gens.append(torch.cuda.default_generators[torch.cuda.current_device()])
        self.start = [(gen, gen.get_state()) for gen in gens]

    def drew(self) -> bool:
        """Whether a generator's state after a saved random op differs from its state as the forward began (or is of a
        generator not read then): only then does recomputation need the states replayed. SDPA is a random op by its
        tag, saved by default, and with ``dropout_p=0`` (every model without attention dropout) it draws nothing: the
        replay mode then set each state to the one it already had, and as a second Python mode over every recomputed
        op it cost ~0.7 ms of CPU per ``nano`` block and step (docs/benchmarks.md). A generator only moves forward, so
        states equal to the start mean nothing drew up to the last saved random op."""
        start = {id(gen): state for gen, state in self.start}
        return any(id(gen) not in start or not torch.equal(state, start[id(gen)])
                   for _, states in self.after for gen, state in states)


class _ReplayRngStates(TorchDispatchMode):
    """Recompute mode above selective checkpointing's: after each saved random op (handed back from the cache,
    not run) the generators get the states that :class:`_RandomOpsSaved` read after it in forward."""

    def __init__(self, saved: _RandomOpsSaved) -> None:
        super().__init__()
        self.saved = saved
        self.index = 0

    def __enter__(self):
        self.index = 0  # a second recomputation (retain_graph) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        after = self.saved.after
        if self.index < len(after) and func is after[self.index][0]:
            for gen, state in after[self.index][1]:
                gen.set_state(state)
            self.index += 1
        return out


def _storages(value) -> list[int]:
    """The storage addresses of the (non-empty, dense) tensors in ``value``; a wrapper tensor subclass's are its inner
    tensors' (DTensor's local shard, a float8 tensor's data): it has no storage of its own, and reading one raised
    'Attempted to access the data pointer on an invalid python storage' in the forward of a block whose Linear had a
    subclass weight, which selective checkpointing ran exactly before the in-place check. A wrapper that does not
    flatten (``__tensor_flatten__``) gives none: it cannot be checked."""
    found = []
    for t in tree_leaves(value):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not t.numel() or t.device.type == "meta":
            continue
        if is_traceable_wrapper_subclass(t):
            found += _storages([getattr(t, name) for name in t.__tensor_flatten__()[0]])
            continue
        try:
            found.append(t.untyped_storage().data_ptr())
        except RuntimeError:  # a wrapper subclass that does not flatten (torch's LoggingTensor): no storage of its
            pass  # own nor inner tensors to name, so none to compare (it failed the forward with the same error)
    return found


def _generators(leaves: list) -> list[torch.Generator]:
    """The default generators of the devices of the tensors in ``leaves``, and the CPU's."""
    gens = {"cpu": torch.random.default_generator}
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta") and str(t.device) not in gens:
            mod = torch.get_device_module(t.device.type)
            gens[str(t.device)] = mod.default_generators[mod.current_device() if t.device.index is None
                                                         else t.device.index]
    return list(gens.values())


def eager_context_fn(context_fn: Callable, block: str = "the block") -> Callable:
    """``context_fn`` (of :func:`selective_context_fn`) for an eager checkpointed call: recomputation also restores
    the RNG states after the saved random ops (:class:`_RandomOpsSaved`). The recompute mode is pushed only where
    forward saved a random op that drew (:meth:`_RandomOpsSaved.drew`), so the common case pays no second Python
    mode. (Under ``torch.compile`` the plain ``context_fn`` is passed: the partitioner decides what is recomputed,
    and it saves random ops' outputs.)"""

    def contexts():
        saved = _RandomOpsSaved(context_fn.args[0], block)
        saved.begin()  # checkpoint calls this right before the block's forward
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(saved)
        return forward_ctx, _Replaying(saved, recompute_ctx, block)

    return contexts


class _EnteredTogether:
    """Context managers entered in order, and again at each recomputation: checkpoint enters a recompute context
    once per backward through the block. (A generator-based one can be entered once: a second backward,
    ``retain_graph=True`` or two losses through one block, failed in ``contextlib`` with ``AttributeError:
    '_GeneratorContextManager' object has no attribute 'args'``, under ``full`` for a block with buffers too, which
    torch's checkpoint supports.)"""

    def __init__(self, *contexts) -> None:
        self.contexts = contexts
        self.stack: contextlib.ExitStack | None = None

    def _to_enter(self) -> tuple:
        return self.contexts

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self._to_enter():
                stack.enter_context(context)
            self.stack = stack.pop_all()

    def __exit__(self, *exc):
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc)


class _Replaying(_EnteredTogether):
    """Recompute context of one eager selective call: selective checkpointing's, and above it
    :class:`_ReplayRngStates` where forward saved a random op. torch's selective checkpointing recomputes for one
    backward only; its error at a second one is given the fix."""

    def __init__(self, saved: _RandomOpsSaved, recompute_ctx, block: str) -> None:
        super().__init__(recompute_ctx)
        self.saved, self.block = saved, block

    def _to_enter(self) -> tuple:
        return (*self.contexts, _ReplayRngStates(self.saved)) if self.saved.after and self.saved.drew() else \
            self.contexts

    def __exit__(self, *exc):
        suppressed = super().__exit__(*exc)
        error = exc[1]
        if isinstance(error, RuntimeError) and "backward an extra time" in str(error):
            from lit_dtrain.errors import ConfigError

            raise ConfigError(
                f"SelectiveCheckpointing: a second backward through a {self.block} block checkpointed with the "
                "selective policy (retain_graph=True, or torch.autograd.grad then backward): torch's selective "
                "checkpointing recomputes a block for one backward only; checkpoint these blocks with policy='full' "
                "(recomputed at each backward), or leave them out of module_pattern") from error
        return suppressed


class _ReplayBuffers:
    """Recompute context of one checkpointed call: the block's buffers hold, during recomputation, the values they had
    when its forward started, and afterwards get back the values they had before it.

    Recomputation ran on the buffers as forward had left them: an in-place update in the forward (BatchNorm's running
    statistics, a counter) counted twice, and a block that reads a buffer it updates (``n += 1; y = x * (n + 0)``)
    recomputed with the new value: its gradients were silently off (7.6 max abs in that example). All buffers are
    copied, because aten's batch norm updates the running statistics without bumping their version counters, so which
    buffers changed cannot be told without comparing values. The copies of the forward's start are kept until the
    backward (BatchNorm's statistics are a few vectors; a large buffer costs its size per checkpointed call).
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.at_forward = [b.detach().clone() for b in buffers]
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        with torch.no_grad():
            self.saved = [b.detach().clone() for b in self.buffers]
            for b, value in zip(self.buffers, self.at_forward):
                b.copy_(value)

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for b, value in zip(self.buffers, self.saved):
                b.copy_(value)
        self.saved = []


def with_buffers_replayed(buffers: list[torch.Tensor], context_fn: Callable) -> Callable:
    """``context_fn`` whose recompute context also replays ``buffers`` (:class:`_ReplayBuffers`, outside the
    selective-checkpointing mode, so that its copies are not cached or recomputed ops)."""

    def contexts():
        replay = _ReplayBuffers(buffers)  # called by checkpoint as its forward starts
        forward_ctx, recompute_ctx = context_fn()
        return forward_ctx, _EnteredTogether(replay, recompute_ctx)

    return contexts
