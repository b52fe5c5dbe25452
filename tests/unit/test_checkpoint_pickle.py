"""A model with checkpointed blocks pickles whole (``torch.save(model)``) and deep-copies, and trains the same."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.callbacks._checkpoint_policies import apply_checkpointing
from lit_dtrain.models import Llama, LlamaConfig


def saved_and_loaded(model):
    buf = io.BytesIO()
    torch.save(model, buf)  # failed: "<pybind11 ... function_record> is not pickleable" (torch's op objects)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("clone", [saved_and_loaded, copy.deepcopy])
def test_patched_model_pickles_whole(clone):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=2, d_model=32, n_head=2, n_kv_head=1, block_size=16, dropout=0.1))
    apply_checkpointing(list(model.blocks), ["selective", "full"], ["aten.mm", "aten.bmm.default"])
    other = clone(model)
    wrappers = [b.__dict__["forward"] for b in other.blocks]
    assert [w.mode for w in wrappers] == ["selective", "full"]
    assert all(w.inner.__self__ is b for w, b in zip(wrappers, other.blocks))  # its own block, not the original's
    assert sorted(map(str, wrappers[0].context_fn.args[0].ops)) == ["aten.bmm.default", "aten.mm"]
    ids = torch.randint(0, 257, (2, 9))
    for m in (model, other):
        torch.manual_seed(1)
        F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert [w.calls for w in wrappers] == [1, 1]
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a.grad, b.grad)
