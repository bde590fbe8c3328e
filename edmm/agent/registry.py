"""`Registry`: named factories of pluggable policies, instead of if/elif chains."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from edmm.agent.errors import UnknownPolicyError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named factories of pluggable policies (speculation sources, retention policies)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._factories: dict[str, Callable[[], T]] = {}

    def register(self, name: str) -> Callable[[Callable[[], T]], Callable[[], T]]:
        """Decorator: register a factory (usually the class) under ``name``."""
        def deco(factory: Callable[[], T]) -> Callable[[], T]:
            if name in self._factories:
                raise ValueError(f"{self.what} {name!r} is already registered")
            self._factories[name] = factory
            return factory
        return deco

    def create(self, name: str) -> T:
        """A new instance of the policy registered as ``name`` (`UnknownPolicyError`)."""
        factory = self._factories.get(name)
        if factory is None:
            raise UnknownPolicyError(f"unknown {self.what} {name!r}; known: {sorted(self)}")
        return factory()

    def __iter__(self) -> Iterator[str]:
        return iter(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories
