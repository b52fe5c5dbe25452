"""An option a list of a config group names that the group lacks (``callbacks=[default,loss_spik]``): one line naming
the override, the closest option and the group's options. Hydra printed "In 'train': Could not load
'callbacks/loss_spik'." and its config search path, 6 lines listing no option (for one option, ``model=nanoo``, it
lists them: 'Could not find', left to Hydra)."""

from __future__ import annotations

import difflib
from pathlib import Path


def missing_option_message(error: BaseException, args: list[str], config_dir: str | None) -> str | None:
    """The line for Hydra's 'Could not load '<group>/<name>'' of an option ``config_dir``/<group> lacks, naming the
    override of the command line ``args`` that sets the group, else None (a group of another config dir,
    ``--config-dir`` or ``hydra.searchpath``, whose options the app's dir does not list: Hydra's report)."""
    from hydra.errors import MissingConfigException

    from lit_dtrain._compose_errors import _other_config_dirs, group_options_in

    missing = getattr(error, "missing_cfg_file", None)
    if not isinstance(error, MissingConfigException) or not isinstance(missing, str) or \
            f"Could not load '{missing}'." not in str(error) or config_dir is None or _other_config_dirs(args):
        return None
    group, _, name = missing.rpartition("/")
    if not group or not Path(config_dir, group).is_dir() or Path(config_dir, group, f"{name}.yaml").is_file():
        return None
    options = group_options_in(config_dir, group)
    close = difflib.get_close_matches(name, options, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    given = next((a for a in args if a.lstrip("+~").partition("=")[0] == group and name in a), None)
    where = f"'{given}': " if given else ""
    return f"{where}config group '{group}' has no option '{name}' ({hint}options: {', '.join(options) or 'none'})"
