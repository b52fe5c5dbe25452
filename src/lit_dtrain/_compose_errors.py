"""A key the composed config lacks, set on the command line (``python train.py optimizer.lrr=1e-3``,
``trainer.max_step=5``): one line naming it and the closest key there is, ``error: optimizer.lrr is not a config key;
did you mean 'optimizer.lr'?`` (else the keys its section holds). Hydra printed 'Could not override ...', 'To append
to your config use +optimizer.lrr=1e-3' (the wrong fix for a typo: AdamW then refused ``lrr``) and OmegaConf's 'Key
'lrr' is not in struct', suggesting nothing.

Hydra composes before any code of the entry point runs and prints its own errors (``run_and_report``), so
:func:`run_reporting_unknown_keys` has Hydra raise them until the task function starts (Hydra's own switch,
``HYDRA_FULL_ERROR=1``, which :func:`composed` takes back as the task function starts): a key the config lacks is
reported here, any other error by Hydra's own ``run_and_report``, as before. A user's own ``HYDRA_FULL_ERROR=1`` is
left alone (Hydra's full traceback, as asked)."""

from __future__ import annotations

import os
import sys

_FULL_ERROR = "HYDRA_FULL_ERROR"
_set_here = False  # whether this process set HYDRA_FULL_ERROR=1 (until the task function starts)


def run_reporting_unknown_keys(main) -> None:
    """Run a ``@hydra.main`` function ``main`` (no arguments: Hydra reads ``sys.argv``), reporting a key the config
    lacks in one line with exit status 1 (Hydra's was 1 too)."""
    global _set_here
    if os.environ.get(_FULL_ERROR) == "1":
        main()
        return
    os.environ[_FULL_ERROR], _set_here = "1", True
    try:
        main()
    except Exception as e:  # noqa: BLE001 - raised only before the task function ran; reported as Hydra would
        composed()
        error = e
        message = unknown_key_message(error)
        if message is None:
            from hydra._internal.utils import run_and_report

            run_and_report(lambda: _raise(error))  # Hydra's own report, and exit 1
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        composed()


def composed() -> None:
    """Called as the task function starts: Hydra reports errors from here on as it always does (a sweep's failed
    job, the run's own errors, and the processes Lightning starts, which inherit the environment)."""
    global _set_here
    if _set_here:
        os.environ.pop(_FULL_ERROR, None)
        _set_here = False


def full_error_asked() -> bool:
    """Whether the user asked for Hydra's full errors (``HYDRA_FULL_ERROR=1``), not :func:`run_reporting_unknown_keys`
    while Hydra composes: the Hydra callbacks' one-line refusals (``run_name=''``) raised instead, and Hydra, which
    only logs a callback's exception, started the run (it trained into ``outputs/runs`` itself)."""
    return os.environ.get(_FULL_ERROR) == "1" and not _set_here


def _raise(error: BaseException):
    raise error


def unknown_key_message(error: BaseException) -> str | None:
    """The one line for Hydra's 'Could not override' error of a key its node lacks (OmegaConf's 'not in struct'), with
    the closest key of that node, else None."""
    from hydra.errors import ConfigCompositionException
    from omegaconf import DictConfig
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from lit_dtrain.config_keys import _not_accepted  # the closest key (difflib), as for a target's arguments

    cause = error.__cause__
    if not isinstance(error, ConfigCompositionException) or not isinstance(
            cause, (ConfigKeyError, ConfigAttributeError)):
        return None
    parent, key, full_key = cause.parent_node, cause.key, cause.full_key
    if not isinstance(parent, DictConfig) or not isinstance(key, str) or "not in struct" not in cause.msg:
        return None
    section = full_key[: -len(key)].rstrip(".")
    keys = sorted(k for k in map(str, parent.keys()) if section or k != "hydra")
    if hint := _not_accepted(key, set(keys), {}, prefix=f"{section}." if section else ""):
        return f"{full_key} is not a config key{hint}"
    where = f"{section} holds" if section else "the top level holds"
    return f"{full_key} is not a config key ({where} {', '.join(keys)})"
