"""Settings whose given values are normalised before construction, never after.

A settings class (a frozen dataclass) that takes a value in more than one form (``"user,system"``
or ``("user", "system")``), or derives one from the others (no method given: ``default``, or
``auto`` with a budget), subclasses :class:`NormalisedSettings` and says how in its
:meth:`~NormalisedSettings.normalised` classmethod: calling the class (``RunSettings(roles="a,b")``,
:func:`dataclasses.replace`, a command's parsed options) normalises the given keywords first, then
constructs, and ``__post_init__`` only checks. A constructed object is never changed.
"""

from __future__ import annotations

import dataclasses

from typing import Any

__all__ = ("Normalised", "NormalisedSettings", "given_or_default")


class Normalised(type):
    """The metaclass of :class:`NormalisedSettings`: ``cls(**given)`` constructs
    ``cls(**cls.normalised(given))``."""

    def __call__(cls, *args: Any, **given: Any) -> Any:
        normalised = getattr(cls, "normalised", None)
        return super().__call__(*args, **(normalised(dict(given)) if normalised is not None else given))


class NormalisedSettings(metaclass=Normalised):
    """A settings class whose keywords are normalised before construction (module docs)."""

    __slots__ = ()

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """The keywords to construct with, from the keywords ``given`` (a fresh dict, this
        method's to change): as given, unless a subclass says otherwise.

        Raises:
            ConfigError: a value that cannot be normalised (naming the field), in a subclass.
        """
        return given


def given_or_default(cls: type, given: dict[str, Any], name: str) -> Any:
    """The value the field ``name`` of the dataclass ``cls`` will hold: ``given``'s, else the field's default.

    Raises:
        KeyError: ``cls`` has no field ``name`` with a default.
    """
    if name in given:
        return given[name]
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(name)
