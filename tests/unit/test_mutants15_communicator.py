"""``lit_dtrain.strategies._communicator`` where the fifteenth hand mutation audit's mutants passed its tests: on a
torch with ``dist.all_gather_single`` (2.13) the gather calls it, not the name 2.13 deprecates (the fallback to
``all_gather_into_tensor`` on older torch: test_compressors_resume.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_dtrain.strategies import _communicator


def test_all_gather_calls_all_gather_single_where_torch_has_it(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_gather_single", lambda out, t, group=None, async_op=False:
                        calls.append((out, t, group, async_op)) or "work", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: "deprecated")
    out, t = torch.empty(4), torch.ones(2)
    assert _communicator._all_gather_single(out, t, group="g", async_op=True) == "work"
    assert len(calls) == 1 and calls[0][0] is out and calls[0][1] is t and calls[0][2:] == ("g", True)
