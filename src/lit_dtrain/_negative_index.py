"""An override that names a list item from the end (``data.sources.-1.weight=2``): one line saying Hydra's grammar has
no negative index, with the item's index from 0. Hydra's lexer refused it in three lines ('LexerNoViableAltException:
data.sources.-1.weight=2', a caret, a link to the grammar), naming neither the cause nor the form it takes."""

from __future__ import annotations

import re

_NEGATIVE = re.compile(r"(?<=\.)-(\d+)(?=\.|=|$)")  # a key part '-1' (a value's '-1' follows the '=')


def negative_index_message(error: BaseException, args: list[str], config_dir: str | None) -> str | None:
    """The line for Hydra's parse error of an override of the command line ``args`` whose key has a negative index,
    else None. The positive form is read from the config that the other overrides compose (the list's length);
    where that config cannot be composed here (a sweep, another config name or dir), the line says how to count."""
    from hydra.errors import OverrideParseException

    if not isinstance(error, OverrideParseException):
        return None
    arg = next((a for a in args if not a.startswith("-") and _NEGATIVE.search(a.partition("=")[0])), None)
    if arg is None:
        return None
    key, sign, value = arg.partition("=")
    prefix = key[: len(key) - len(key.lstrip("+~"))]
    match = _NEGATIVE.search(key)
    parent, index = key[len(prefix): match.start() - 1], -int(match.group(1))
    rest = key[match.end():]
    said = f"'{arg}': Hydra's override grammar has no negative list index ({index})"
    length = _list_length(parent, [a for a in args if a != arg], config_dir)
    if prefix == "~" and not rest:  # an item itself: Hydra 1.3 cannot delete one at any index (hydra#2477)
        return (f"{said}, and cannot delete a list item at all (hydra#2477): set the list whole without it, "
                f"'{parent}=[...]'")
    if length is None:
        return (f"{said}: give the item's index counted from 0 ('{prefix}{parent}.<index>{rest}{sign}{value}'; "
                "'--cfg job' shows the list)")
    items = f"{length} item{'s' if length != 1 else ''}"
    if length < -index:
        return f"{said}, and {parent} holds {items}, none {-index} from the end; set the list whole ('{parent}=[...]')"
    return f"{said}: {parent} holds {items}, so give '{prefix}{parent}.{length + index}{rest}{sign}{value}'"


def _list_length(parent: str, others: list[str], config_dir: str | None) -> int | None:
    """The length of the list ``parent`` in the ``train`` config that ``others`` (the other overrides) compose from
    ``config_dir``; None where it is no list or the config cannot be composed here (any error: the line counts
    instead)."""
    from omegaconf import ListConfig, OmegaConf

    from lit_dtrain._compose_errors import _other_config_dirs

    if config_dir is None or _other_config_dirs(others) or any(a in ("-cn", "--config-name") or a.startswith(
            ("-cn=", "--config-name=")) for a in others):
        return None
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose("train", overrides=[a for a in others if "=" in a and not a.startswith("-")
                                              or a.startswith("~")])
        node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False)
    except Exception:  # noqa: BLE001 - a sweep's 'a=1,2', an override that fails itself: counted by the user
        return None
    return len(node) if isinstance(node, ListConfig) else None
