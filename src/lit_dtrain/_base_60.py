"""Where a config file writes a time unquoted, which YAML 1.1 reads as a base-60 integer: ``val_check_interval:
1:00:00:00`` composes as 216000 (steps), with no word that the file gave a duration."""

from __future__ import annotations

import re
from pathlib import Path

_BASE_60 = r"[1-9][0-9_]*(?::[0-5]?[0-9])+"  # YAML 1.1's sexagesimal integer (a first field of 0 is a string)


def base_60_source(key: str, value) -> tuple[Path, str] | None:
    """The config file of this Hydra run, and the text in it, where ``<leaf of key>: <H:MM:SS ...>`` is written
    unquoted and YAML's base-60 reading of it is ``value`` (an hour's seconds or more: H:MM:SS); None where no file
    does (a value given as an integer, one from the command line, whose parser reads no base-60: also where a file
    writes the time and the command line sets ``key`` to its number, which was refused as coming from the file; or
    no Hydra run). The primary config and the group options this run chose are read where the run's config sources
    hold them (the app's conf dir, ``--config-dir``, ``hydra.searchpath``); another file of a dir, not composed,
    never counts."""
    from hydra.core.hydra_config import HydraConfig

    if isinstance(value, bool) or not isinstance(value, int) or value < 3600 or not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if any(str(o).lstrip("+~").split("=")[0] == key for o in hydra.overrides.task):  # set on the command line
        return None
    leaf = key.rsplit(".", 1)[-1]
    written = re.compile(rf"^[ \t]*{re.escape(leaf)}[ \t]*:[ \t]*({_BASE_60})[ \t]*(?:#.*)?$", re.MULTILINE)
    chosen = [f"{hydra.job.config_name}.yaml"] + [f"{group}/{option}.yaml" for group, option in
                                                  hydra.runtime.choices.items() if isinstance(option, str)]
    for source in hydra.runtime.config_sources:
        for name in chosen if source.schema == "file" else ():
            try:
                text = (Path(source.path) / name).read_text()
            except (OSError, UnicodeDecodeError):  # not in this dir
                continue
            for match in written.finditer(text):
                number = 0
                for field in match[1].replace("_", "").split(":"):
                    number = number * 60 + int(field)
                if number == value:
                    return Path(source.path) / name, match[1]
    return None
