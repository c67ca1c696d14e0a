"""Name -> component registries (methods, datasets, metrics) with kind errors.

Registries are the only module-level state in kvbench. An unknown name gets a one-line error that names the
closest match and every valid choice, so a typo in a sweep fails before any model is loaded.
"""
from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A dict of named components, filled by a decorator: `@METHODS.register("snapkv")`."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} '{name}' is already registered by {self._items[name]!r}")
            self._items[name] = obj
            setattr(obj, "registry_name", name)
            return obj

        return wrap

    def __getitem__(self, name: str) -> T:
        if name not in self._items:
            raise KeyError(unknown_choice(self.kind, name, self.names()))
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return sorted(self._items)


def unknown_choice(kind: str, value: str, choices: list[str]) -> str:
    """'Unknown method 'snapk'. Did you mean: snapkv? Available: full, snapkv, ...' (one line)."""
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f" Did you mean: {close[0]}?" if close else ""
    return f"Unknown {kind} '{value}'.{hint} Available: {', '.join(sorted(choices))}"


METHODS: Registry = Registry("method")
DATASETS: Registry = Registry("dataset")
METRICS: Registry = Registry("metric")
