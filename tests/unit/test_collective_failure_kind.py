"""Which errors :func:`lit_dtrain.utils.distributed.is_collective_failure` takes for a failed collective: torch's
distributed error types and a ``RuntimeError`` torch's native code raised with gloo's words; not a project's own
``RuntimeError`` whose text happens to say 'peer' or 'timed out' (it is that rank's own error, recorded for the
others). The 2-rank run of it is in tests/dist/test_rank_failure_named.py."""

from __future__ import annotations

import ctypes
from datetime import timedelta

import pytest
import torch.distributed as dist

from lit_dtrain.utils.distributed import FirstConnectionError, PeerRankFailedError, is_collective_failure

GLOO_TEXT = "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46000"


def _raised(fn) -> BaseException:
    with pytest.raises(BaseException) as info:
        fn()
    return info.value


def _raise_natively(text: str) -> None:
    """Raise ``RuntimeError(text)`` from native code, as torch's C++ raises gloo's error (not a Python ``raise``)."""
    ctypes.pythonapi.PyErr_SetString(ctypes.py_object(RuntimeError), text.encode())


def _raise_in_python(text: str) -> None:
    raise RuntimeError(text)


def test_a_projects_own_runtime_error_with_collective_words_is_not_a_collective_failure():
    for text in ("connection to the peer database timed out", GLOO_TEXT, "gloo: timeout"):
        assert not is_collective_failure(_raised(lambda text=text: _raise_in_python(text))), text
    assert not is_collective_failure(RuntimeError(GLOO_TEXT))  # never raised


def test_gloos_native_runtime_error_and_torchs_distributed_errors_are():
    assert is_collective_failure(_raised(lambda: _raise_natively(GLOO_TEXT)))
    assert is_collective_failure(_raised(lambda: _raise_natively("Timed out waiting 8000ms for recv operation")))
    assert not is_collective_failure(_raised(lambda: _raise_natively("mat1 and mat2 shapes cannot be multiplied")))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=0.1))
    store_error = _raised(lambda: store.get("never set"))
    assert isinstance(store_error, dist.DistStoreError) and is_collective_failure(store_error)


def test_an_error_raised_from_a_failed_collective_is_one_and_lit_dtrains_own_lines_are_not():
    def wrapped():
        try:
            _raise_natively(GLOO_TEXT)
        except RuntimeError as e:
            raise RuntimeError("rank 0: a collective failed at step 3") from e

    assert is_collective_failure(_raised(wrapped))  # train.py's CollectiveError is raised from gloo's error
    for own in (PeerRankFailedError, FirstConnectionError):
        def raise_own(own=own):
            try:
                _raise_natively(GLOO_TEXT)
            except RuntimeError as e:
                raise own("rank 0: a collective failed") from e

        assert not is_collective_failure(_raised(raise_own)), own
