"""One registry type for every extension point: estimators (``--method``), utilities
(``--utility``), absence policies (``--absence-policy``), backends (``--backend``) and input
readers (by file suffix).

A :class:`Registry` maps names to entries, in registration order. It is a read-only mapping
(``name in r``, ``r[name]``, ``r.items()``, iteration), read live: a name registered later is in
every later read, including the CLI's choices and help. On top of the mapping it gives:

- :meth:`Registry.register`: a new name, checked by the registry's own ``check``; a name already
  bound to another entry is refused unless ``replace=True`` (registering the same (equal) entry
  again is a no-op, so a module imported twice or a test that registers in a fixture does no harm);
- :meth:`Registry.names`: the registered names, in registration order;
- :meth:`Registry.lookup`: the entry of a name, or one :class:`~coalescence.errors.ConfigError`
  naming the registry's field, with a "did you mean" (:func:`~coalescence.userinput.did_you_mean`)
  and the names to choose from;
- :meth:`Registry.create`: call an entry that is a factory with settings, each setting checked
  against the factory's parameters first (an unknown one is refused with its own "did you mean"),
  so that a registered absence policy brings its own settings and the registry validates them.

This module is on the ground floor: it imports only the error tree and :mod:`coalescence.userinput`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from .errors import ConfigError
from .userinput import did_you_mean

__all__ = ("Registry", "settings_of")

T = TypeVar("T")


def settings_of(factory: Callable[..., Any]) -> tuple[str, ...] | None:
    """The keyword settings ``factory`` accepts: a dataclass's init fields, else the named
    parameters of its signature; ``None`` when it takes ``**kwargs`` (anything goes) or has no
    signature Python can read."""
    if isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return tuple(f.name for f in dataclasses.fields(factory) if f.init)
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return tuple(p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name, in registration order.

    Args:
        kind: what an entry is, in messages (``"method"``, ``"absence policy"``).
        field: the setting an unknown name is reported against (``"method"``, ``"absence_policy"``).
        check: ``check(name, entry)`` raises :class:`~coalescence.errors.ConfigError` for an entry
            the registry refuses (e.g. an estimator without capabilities); ``None``: any entry.
        normalize: maps a name before it is registered or looked up (``str.lower`` for file
            suffixes); ``None``: names as given.
        alternatives: text appended to the choices in an unknown-name message
            (``", or shapiq:<Approximator>"``).
        choose: the words before the choices (``"use one of "``).

    A name bound to ``None`` (as ``monkeypatch.setitem(r, name, None)`` leaves it) is free.
    """

    def __init__(
        self,
        kind: str,
        *,
        field: str,
        check: Callable[[str, T], None] | None = None,
        normalize: Callable[[str], str] | None = None,
        alternatives: str = "",
        choose: str = "use one of ",
    ) -> None:
        self.kind = kind
        self.field = field
        self._check = check
        self._normalize = normalize
        self._alternatives = alternatives
        self._choose = choose
        self._entries: dict[str, T] = {}

    # -- the mapping (read live) -----------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        entry = self._entries[self._key(name)]
        if entry is None:
            raise KeyError(name)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._entries.get(self._key(name)) is not None

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"

    # what monkeypatch.setitem/delitem and a test's clean-up use: a raw set and removal, unchecked
    def __setitem__(self, name: str, entry: T) -> None:
        self._entries[self._key(name)] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[self._key(name)]

    def pop(self, name: str, default: Any = None) -> Any:
        """Remove ``name`` and return its entry (``default`` when it is not registered)."""
        return self._entries.pop(self._key(name), default)

    def _key(self, name: str) -> str:
        return self._normalize(name) if self._normalize is not None and isinstance(name, str) else name

    # -- the registry ----------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(k for k, v in self._entries.items() if v is not None)

    def register(self, name: str, entry: T, *, replace: bool = False) -> None:
        """Register ``entry`` under ``name``.

        Args:
            name: a non-empty string (normalized first, when the registry normalizes names).
            entry: what the name stands for (checked by the registry's ``check``).
            replace: replace an entry already registered under ``name``.

        Raises:
            ConfigError: an empty or non-string name, an entry ``check`` refuses, or a name already
                bound to another entry without ``replace`` (field: the registry's).
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"register a {self.kind} under a non-empty name, got {name!r}", field=self.field)
        if self._check is not None:
            self._check(name, entry)
        key = self._key(name)
        existing = self._entries.get(key)
        if existing is not None and not replace and not _same(existing, entry):
            raise ConfigError(
                f"the {self.kind} {key!r} is already registered ({_describe(existing)}); pick another name, or pass "
                "replace=True to replace it",
                field=self.field,
            )
        self._entries[key] = entry

    def unknown(self, name: object) -> ConfigError:
        """The error for an unknown ``name``: ``unknown KIND 'x' (did you mean y?); use one of ...``."""
        names = self.names()
        return ConfigError(
            f"unknown {self.kind} {name!r}{did_you_mean(name, names)}; {self._choose}{', '.join(names)}{self._alternatives}",
            field=self.field,
        )

    def lookup(self, name: object) -> T:
        """The entry registered as ``name``.

        Raises:
            ConfigError: ``name`` is not registered (the registry's field, with a "did you mean"
                and the registered names).
        """
        entry = self._entries.get(self._key(name)) if isinstance(name, str) else None
        if entry is None:
            raise self.unknown(name)
        return entry

    def create(self, name: object, /, **settings: Any) -> Any:
        """Call the factory registered as ``name`` with ``settings``, each checked against the
        factory's parameters first (:func:`settings_of`).

        Raises:
            ConfigError: an unknown name (see :meth:`lookup`), a setting the factory does not take
                (naming it, with a "did you mean" and the settings it does take), or the factory's own
                refusal of a value (a ``TypeError`` becomes a ``ConfigError`` naming the entry).
        """
        factory = self.lookup(name)
        accepted = settings_of(factory)  # type: ignore[arg-type]
        if accepted is not None:
            for key in settings:
                if key not in accepted:
                    known = ", ".join(accepted) if accepted else "none"
                    raise ConfigError(
                        f"the {self.kind} {name!r} has no setting {key!r}{did_you_mean(key, accepted)}; its settings: {known}",
                        field=self.field,
                    )
        try:
            return factory(**settings)  # type: ignore[operator]
        except TypeError as exc:
            raise ConfigError(f"bad parameters for {name!r}: {exc}", field=self.field) from exc


def _same(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an entry whose == refuses (an array): not the same
        return False


def _describe(entry: object) -> str:
    return getattr(entry, "__qualname__", None) or type(entry).__name__
