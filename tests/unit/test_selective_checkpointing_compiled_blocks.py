"""SelectiveCheckpointing on blocks a project compiled one by one (``torch.compile(block)`` in its ``__init__``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import SelectiveCheckpointing


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))


class _Net(pl.LightningModule):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 16), nn.Linear(16, 16)
        blocks = [_Block(16) for _ in range(2)]
        self.blocks = nn.ModuleList([torch.compile(b, backend="aot_eager") if compiled else b for b in blocks])
        self.example_input_array = torch.zeros(2, 8, dtype=torch.long)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, _):
        return nn.functional.cross_entropy(self(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _EagerCallsAtTrainStart(pl.Callback):
    def __init__(self, checkpointing: SelectiveCheckpointing, calls: list) -> None:
        self.checkpointing, self.calls = checkpointing, calls

    def on_train_start(self, trainer, pl_module) -> None:  # (the budget probe's eager calls come before)
        self.calls.extend(w.calls for w in self.checkpointing.wrappers)


def _fit(callbacks: list, compiled: bool = True, net: type = _Net) -> tuple[torch.Tensor, _Net]:
    torch.manual_seed(0)
    module = net(compiled)
    data = DataLoader(torch.randint(0, 16, (8, 9), generator=torch.Generator().manual_seed(1)), batch_size=4)
    pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=callbacks).fit(module, data)
    return torch.cat([p.detach().flatten() for p in module.parameters()]), module


@pytest.mark.parametrize("policy", ["selective", "budget"])
def test_blocks_compiled_one_by_one_checkpoint_inside_their_compiled_code(policy):
    # The wrapper went around the OptimizedModule, outside its compiled code: `selective` under inductor failed in
    # backward with "Tensor cached during selective activation checkpoint has been mutated", and the budget probe,
    # through the compiled blocks, with "module OptimizedModule did not run in step_fn".
    reference, _ = _fit([], compiled=False)
    callback = SelectiveCheckpointing(policy=policy)
    at_start = []
    weights, module = _fit([callback, _EagerCallsAtTrainStart(callback, at_start)])
    assert torch.equal(weights, reference)
    assert callback.block_names == ["blocks.0", "blocks.1"]
    assert all(type(block).__name__ == "OptimizedModule" for block in module.blocks)  # the probe put them back
    assert "none" not in callback.plan
    # checkpointed in the steps, inside the compiled code: no eager call (`calls`; around it: 2 each in 2 steps)
    assert [(w.ran, w.calls) for w in callback.wrappers] == [(True, n) for n in at_start]


class _Core(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(16) for _ in range(2)])

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return h


class _CompiledCore(_Net):
    """The blocks inside a model compiled whole: ``core._orig_mod.blocks``."""

    def __init__(self, compiled: bool) -> None:
        super().__init__(False)
        core = _Core()
        core.blocks = self.blocks
        del self.blocks
        self.core = torch.compile(core, backend="aot_eager")

    def forward(self, idx):
        return self.head(self.core(self.emb(idx)))


def test_the_budget_probe_runs_the_blocks_of_a_model_compiled_whole():
    # The probe ran through the compiled model, whose blocks MemTracker does not see: "module _Block did not run".
    reference, _ = _fit([], compiled=False)
    callback = SelectiveCheckpointing(policy="budget")
    weights, module = _fit([callback], net=_CompiledCore)
    assert torch.equal(weights, reference)
    assert callback.block_names == ["core._orig_mod.blocks.0", "core._orig_mod.blocks.1"]
    assert type(module.core).__name__ == "OptimizedModule" and callback.budget_report["fits"]
