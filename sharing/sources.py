"""Where the node's configs come from: the user's ConfigMap, over the shipped presets.

Presets live in their own ConfigMap (`gpu-sharing-presets`, replaced on every upgrade); users own
theirs (`gpu-sharing-config`, never overwritten). Each is parsed on its own, so a broken key in one
spoils nothing in the other, and a name the user defines (valid or not) wins over a preset of the
same name. Pure.
"""

from __future__ import annotations

from sharing.config import CONFIGMAP, ConfigSet


def merge(user: ConfigSet, presets: ConfigSet) -> ConfigSet:
    """The configs a node can select: the user's, then the presets the user does not redefine.

    A user ConfigMap broken as a whole (e.g. over 1 MiB) hides every preset too: which names it
    defines cannot be told, and falling back to a preset of the same name would be a guess.
    """
    if CONFIGMAP in user.invalid:
        return user
    owned = set(user.names) | set(user.invalid)
    kept_invalid = tuple(n for n in presets.invalid if n not in owned and n != CONFIGMAP)
    return ConfigSet(
        configs=user.configs + tuple(c for c in presets.configs if c.name not in owned),
        errors=user.errors + tuple(p for p in presets.errors if p.config in kept_invalid),
        warnings=user.warnings + tuple(p for p in presets.warnings if p.config not in owned),
        invalid=user.invalid + kept_invalid,
    )
