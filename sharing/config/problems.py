"""What is wrong with a config, as data: problems with the config name, the YAML path and a message.

Every stage of parsing reports into one `Report`, so a user sees all errors of a ConfigMap at once
instead of fixing them one run at a time. `InvalidConfigError` carries them across the boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sharing.errors import ConfigError

CONFIGMAP = "<configmap>"
"""The config name of problems with the ConfigMap as a whole (never a valid ConfigMap key)."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One error or warning: which config, where in its YAML (`gpus[1].mig.3g.20gb`), and what."""

    config: str
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.config}: {self.path}" if self.path else self.config
        return f"{where}: {self.message}"

    def as_dict(self) -> dict[str, str]:
        """The JSON shape: {"config", "path", "message"}."""
        return {"config": self.config, "path": self.path, "message": self.message}


class InvalidConfigError(ConfigError):
    """One or more configs are invalid; `problems` lists every error found."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        lines = [str(p) for p in self.problems] or ["invalid config"]
        shown = lines[:20] + ([f"... and {len(lines) - 20} more"] if len(lines) > 20 else [])
        super().__init__("\n".join(shown))


class Report:
    """Collects errors and warnings while one config (or one ConfigMap key) is read."""

    def __init__(self, config: str) -> None:
        self.config = config
        self.errors: list[Problem] = []
        self.warnings: list[Problem] = []
        self._seen: tuple[set[Problem], set[Problem]] = (set(), set())  # errors, warnings (a list scan
        # per problem made a config of 8,000 bad rules take 19 s)

    def error(self, path: str, message: str, *, config: str | None = None) -> None:
        """Record an error at `path` (once: the same problem found twice is one problem)."""
        problem = Problem(config or self.config, path, message)
        if problem not in self._seen[0]:
            self._seen[0].add(problem)
            self.errors.append(problem)

    def warn(self, path: str, message: str, *, config: str | None = None) -> None:
        """Record a warning at `path` (once)."""
        problem = Problem(config or self.config, path, message)
        if problem not in self._seen[1]:
            self._seen[1].add(problem)
            self.warnings.append(problem)

    def has_errors_for(self, config: str) -> bool:
        """True when any error names this config."""
        return any(p.config == config for p in self.errors)


def key(path: str, name: object) -> str:
    """The path of a mapping key below `path`: `gpus[1].mig` + `3g.20gb`."""
    return f"{path}.{name}" if path else str(name)


def item(path: str, index: int) -> str:
    """The path of a list item below `path`: `gpus` + 1 -> `gpus[1]`."""
    return f"{path}[{index}]"
