"""The object a config node's ``_target_`` names, or one line naming the key and the target where it cannot be
imported: ``'+callbacks.x._target_=no.such.Cls'`` was Hydra's ERROR record and a several-line error after 'Seed set
to 1337' (``strategy.compressor._target_=...`` when the strategy was built, later still)."""

from __future__ import annotations

import difflib

from lit_dtrain.errors import ConfigError


def import_reason(error: Exception) -> str:
    """One line for ``error``, raised by Hydra's ``_locate``: the import's own error (``ModuleNotFoundError: No module
    named 'no'``, a ``SyntaxError`` in the module), not Hydra's 3-line wrapper of it."""
    cause = error.__cause__
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def import_target(target, key: str):
    """The object at the dotted path ``target`` (the ``_target_`` of the node at ``key``), as ``instantiate`` finds
    it; a ``ConfigError`` naming ``<key>._target_`` where it cannot be imported, with a close spelling of the name in
    its module, if any. Hydra's ``_locate``: its ``get_object`` logs an ERROR record too."""
    from hydra._internal.utils import _locate

    try:
        return _locate(str(target))
    except Exception as e:  # noqa: BLE001 - ImportError, or a ValueError for 'a..b'
        why, close = _name_missing(str(target)) or (import_reason(e), None)
    hint = f"; did you mean {close!r}?" if close else ": give the dotted path of a class or function"
    where = f"{key}._target_" if key else "_target_"
    raise ConfigError(f"{where}={str(target)!r} cannot be imported ({why}){hint}")


def _name_missing(target: str) -> tuple[str, str | None] | None:
    """Where ``target``'s module imports but has not its last name: ``("module 'torch.optim' has no 'Adamw'",
    'torch.optim.AdamW')``, with a close spelling of a public name of the module (or None); else None (Python's
    'No module named torch.optim.Adamw' named a module)."""
    import importlib

    module_name, _, name = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - no module there ('' too), or one that fails to import: its own error
        return None
    if hasattr(module, name):  # (the attribute itself failed: its own error)
        return None
    names = [n for n in (getattr(module, "__all__", None) or dir(module)) if not n.startswith("_")]
    close = [n for n in names if n.lower() == name.lower()] or difflib.get_close_matches(name, names, n=1)
    return f"module {module_name!r} has no {name!r}", f"{module_name}.{close[0]}" if close else None
