"""The names of the resolvers registered with OmegaConf, for a hint on a mistyped one."""

from __future__ import annotations


def registered_resolvers() -> list[str]:
    """Every resolver name OmegaConf knows now, in the order registered, a project's own included ([] where the
    registry is elsewhere). (omegaconf 2.3 private: ``BaseContainer._resolvers``; its public API has only
    ``OmegaConf.has_resolver``, which cannot list them.)"""
    from omegaconf.basecontainer import BaseContainer

    return [str(name) for name in getattr(BaseContainer, "_resolvers", {})]
