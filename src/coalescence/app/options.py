"""Settings fields that describe their own command-line option (the model: vLLM's ``EngineArgs``).

A settings class is a frozen dataclass composed of *groups* (:class:`SettingsGroup` subclasses,
one per concern: the model, the players, the utility...). Each field is declared with
:func:`option`, whose metadata is everything the command line needs: the help text, the flag, the
parser of its text, the choices. :func:`add_options` adds the options of a settings class to an
``argparse`` parser, one argument group per settings group, and :func:`settings_from` builds the
settings back from the parsed namespace; the command line repeats no field by hand. A settings
class may also be built from its groups, each given whole (:func:`spread_groups`), and each group
read back whole (:func:`group_of`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError
from ..normalised import NormalisedSettings

__all__ = (
    "Option",
    "Options",
    "SettingsGroup",
    "add_options",
    "check_groups",
    "group_of",
    "int_list",
    "names",
    "option",
    "option_fields",
    "positive_float",
    "positive_int",
    "seed",
    "settings_from",
    "spread_groups",
)

Text = str | Callable[[], str]
"""A help text, or a function giving it when the parser is built (e.g. the registered methods)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """How a settings field appears on the command line.

    Attributes:
        help: the help text (``%(default)s`` is argparse's); a callable is called when the parser
            is built, so it can list what is registered then.
        flag: the long option (default: ``--`` and the field's name with ``-`` for ``_``).
        short: a short option (``-o``), or ``None``.
        aliases: more long options for the same field (an earlier name kept, e.g. ``--vllm-url``).
        type: parses the option's text (e.g. :func:`positive_int`); ``None`` keeps the text.
        choices: the allowed values, or a callable giving them when the parser is built.
        metavar: the placeholder in the usage line.
        switch: a flag without a value (``store_true``).
        required: the option must be given.
        cli: ``False`` for a field of the Python API alone (e.g. a loaded backend).
        cli_default: the command line's default when it differs from the API's (e.g. ``archive``:
            the CLI always keeps one); set by :func:`option`'s ``cli_default`` (``has_cli_default``).
        section: the ``--help`` section (a group's title) it is shown in, when not its declaring
            group's: a field a command redeclares with another default stays with its kind.
    """

    help: Text = ""
    flag: str | None = None
    short: str | None = None
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | Callable[[], Any] | None = None
    metavar: str | None = None
    switch: bool = False
    required: bool = False
    cli: bool = True
    cli_default: Any = None
    has_cli_default: bool = False
    section: str | None = None


def option(default: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field with its command-line :class:`Option` (``meta``: its attributes)."""
    if "cli_default" in meta:
        meta["has_cli_default"] = True
    return dataclasses.field(default=default, metadata={"option": Option(**meta)})


class SettingsGroup(NormalisedSettings):
    """A group of settings fields (a frozen dataclass subclassing this), shown as one section of
    ``--help`` titled :attr:`title`, described by :attr:`description`; a group extending another
    with the same title adds its fields to that section. Its given values are normalised before
    construction (:class:`~coalescence.normalised.NormalisedSettings`)."""

    title: ClassVar[str] = ""
    description: ClassVar[str | None] = None


def _groups(cls: type) -> list[type]:
    """The settings groups of ``cls`` in the order their options are shown: depth first through
    the bases in declaration order (a base before the group that extends it), ``cls`` last."""
    out: list[type] = []

    def walk(c: type) -> None:
        for base in c.__bases__:
            walk(base)
        if issubclass(c, SettingsGroup) and c is not SettingsGroup and c not in out:
            out.append(c)

    walk(cls)
    return out


def check_groups(settings: Any) -> None:
    """Each settings group of ``settings`` checks its own fields: its ``check_group`` method, where
    it defines one, in ``--help`` order (a base group before the group that extends it).

    Raises:
        ConfigError: from a group's check, naming the field.
    """
    for group in _groups(type(settings)):
        check = vars(group).get("check_group")
        if check is not None:
            check(settings)


def spread_groups(cls: type, given: dict[str, Any], groups: Mapping[str, type]) -> dict[str, Any]:
    """Nested settings: each group object given (``model=ModelSettings(...)``) spread into its
    fields, before ``cls``'s own normalising (a settings class calls this from its ``normalised``).

    A keyword that is also a field of ``cls`` (e.g. ``model``, the model's name) keeps its flat
    meaning unless its value is a group object, recognised by its type. A group object sets every
    field of its group: the same field given as a flat keyword too is refused.

    Args:
        cls: the settings class (a dataclass; its fields are the flat keywords).
        given: the keywords given (a fresh dict: changed in place and returned).
        groups: keyword -> the group class it takes (an object of that class, or of a group it
            extends, e.g. :class:`~coalescence.app.groups.ArchiveSettings` for ``archive``).

    Returns:
        ``given``, every group object replaced by its fields' values.

    Raises:
        ConfigError: another group's object under a group's keyword, a value that is no group
            object under a keyword that takes only one (``game``), or a field set both by a
            keyword and by a group object (naming the field).
    """
    flat = {f.name for f in dataclasses.fields(cls)}
    spread: dict[str, tuple[str, Any]] = {}  # field -> (the group's keyword, its value)
    for keyword, group in groups.items():
        if keyword not in given:
            continue
        value = given[keyword]
        if isinstance(value, SettingsGroup) and dataclasses.is_dataclass(value):
            if not issubclass(group, type(value)):
                raise ConfigError(f"takes {_a(group.__name__)} object (the {keyword} group), got {_a(type(value).__name__)}", field=keyword)
            del given[keyword]
            spread |= {f.name: (keyword, getattr(value, f.name)) for f in dataclasses.fields(value)}
        elif keyword not in flat:
            raise ConfigError(f"takes {_a(group.__name__)} object (the {keyword} group), got {type(value).__name__}", field=keyword)
    for name, (keyword, value) in spread.items():
        if name in given:
            raise ConfigError(f"is set both by the {keyword} group given and as a keyword of its own; give it in one place", field=name)
        given[name] = value
    return given


def group_of(settings: Any, group: type[Any]) -> Any:
    """The settings group ``group`` of ``settings``, read whole: a ``group`` object holding the
    values of its fields in ``settings`` (e.g. the :class:`~coalescence.app.groups.ModelSettings`
    of a :class:`~coalescence.app.settings.RunSettings`), for a layer that takes that group alone."""
    return group(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(group)})


def option_fields(cls: type) -> Iterator[tuple[type, dataclasses.Field[Any], Option]]:
    """``(group, field, option)`` of every command-line field of the settings class ``cls``, each
    in the group that declares it last (a subclass may redeclare a field with another default)."""
    owner: dict[str, type] = {}
    for group in _groups(cls):
        for name in vars(group).get("__annotations__", {}):
            owner[name] = group
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for group in _groups(cls):
        for name, f in by_name.items():
            opt = f.metadata.get("option")
            if owner.get(name) is group and opt is not None and opt.cli:
                yield group, f, opt


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    exclude: tuple[str, ...] = (),
    help: Mapping[str, str] | None = None,  # noqa: A002 (argparse's word)
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the options of the settings class ``cls`` to ``parser``, one argument group per settings
    group (in ``--help``: its title, then its options).

    Args:
        parser: the (sub)command's parser.
        cls: a settings dataclass composed of :class:`SettingsGroup` subclasses.
        exclude: fields left out (set by the command itself).
        help: a command's own help text for some fields.
        defaults: a command's own defaults for some fields.
    """
    help, defaults = help or {}, defaults or {}
    sections: dict[str, Any] = {}  # by title: a group that extends another shares its section
    # a field shown in another group's section comes first there (``--model`` before the model's other options)
    for group, f, opt in sorted(option_fields(cls), key=lambda item: item[2].section is None):
        if f.name in exclude:
            continue
        title = group.title if opt.section is None else opt.section
        if title not in sections:
            sections[title] = parser.add_argument_group(title or None, group.description if opt.section is None else None)
        text = help.get(f.name, opt.help() if callable(opt.help) else opt.help)
        if f.name in defaults:
            default = defaults[f.name]
        elif opt.has_cli_default:
            default = opt.cli_default
        else:
            default = None if f.default is dataclasses.MISSING else f.default
        flags = [s for s in (opt.short, opt.flag or "--" + f.name.replace("_", "-"), *opt.aliases) if s]
        kwargs: dict[str, Any] = {"dest": f.name, "help": text, "default": default}
        if opt.switch:
            kwargs["action"] = "store_true"
        else:
            if opt.type is not None:
                kwargs["type"] = opt.type
            if opt.choices is not None:
                kwargs["choices"] = opt.choices() if callable(opt.choices) else opt.choices
            if opt.metavar is not None:
                kwargs["metavar"] = opt.metavar
        if opt.required:
            kwargs["required"] = True
        if opt.aliases and not opt.switch:
            kwargs["action"] = _OneSpelling
        sections[title].add_argument(*flags, **kwargs)


class _OneSpelling(argparse.Action):
    """Store an option that has several spellings (``--server-url`` and its earlier ``--vllm-url``),
    refusing two spellings with different values (as the keyword API refuses ``server_url`` and
    ``vllm_url``), where argparse would keep the last one without a word."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        spelled = namespace.__dict__.setdefault("_spelled", {})  # dest -> (option, value), this parse's
        before = spelled.get(self.dest)
        if before is not None and before[0] != option_string and before[1] != values:
            parser.error(
                f"argument {self.option_strings[0]}: is given twice, as {before[0]} {before[1]} and as "
                f"{option_string} {values}; give one, {self.option_strings[0]}"
            )
        spelled[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


def settings_from(cls: type, args: argparse.Namespace, *, exclude: tuple[str, ...] = (), **given: Any) -> Any:
    """The settings ``cls`` from a parsed namespace (every command-line field the parser has but
    those in ``exclude``, as :func:`add_options`), and ``given`` fields set by the command itself."""
    values = {f.name: getattr(args, f.name) for _, f, _ in option_fields(cls) if hasattr(args, f.name) and f.name not in exclude}
    return cls(**(values | given))


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The options one command takes from a settings class, the same fields both ways: :meth:`add`
    puts them on its parser (:func:`add_options`), :meth:`settings` builds the settings back from
    the parsed namespace (:func:`settings_from`).

    Attributes:
        cls: the settings class.
        exclude: its fields the command leaves out (set by the command itself, or not its concern).
        help: the command's own help text for some fields.
        defaults: the command's own defaults for some fields.
    """

    cls: type
    exclude: tuple[str, ...] = ()
    help: Mapping[str, str] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def add(self, parser: argparse.ArgumentParser) -> None:
        add_options(parser, self.cls, exclude=self.exclude, help=self.help, defaults=self.defaults)

    def settings(self, args: argparse.Namespace, **given: Any) -> Any:
        return settings_from(self.cls, args, exclude=self.exclude, **given)


def names(value: str | Iterable[str]) -> tuple[str, ...]:
    """The names in a comma-separated string or a sequence of names, stripped, empty ones left out:
    ``"exact, loo"`` and ``["exact", "loo"]`` both give ``("exact", "loo")``."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(item.strip() for item in items if item.strip())


def int_list(value: Any, name: str, *, minimum: int, what: str) -> tuple[int, ...]:
    """The integers in a comma-separated string or a sequence of integers, repeats dropped, in order:
    ``"64, 128,64"`` gives ``(64, 128)``.

    Args:
        value: the string or sequence given.
        name: the field named by an error.
        minimum: the least integer allowed.
        what: what the integers are, as an error says it (``"positive integers"``).

    Raises:
        ConfigError: an item that is not an integer (a bool is not), or below ``minimum``.
    """
    import numpy as np

    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[int] = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
            try:
                number = int(item)
            except ValueError:
                raise ConfigError(f"expected comma-separated {what}, got {item!r}", field=name) from None
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            number = int(item)
        else:
            raise ConfigError(f"expected comma-separated {what}, got {item!r}", field=name)
        if number < minimum:
            raise ConfigError(f"expected comma-separated {what}, got {number}", field=name)
        if number not in out:
            out.append(number)
    return tuple(out)


# -- the options' text parsers (argparse ``type=``): a bad value is one line naming the option ----------------
def positive_int(text: str) -> int:
    """A positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def seed(text: str) -> int:
    """A seed: a non-negative integer of any size (the rule of every method)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer (any size), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer (any size), got {value}")
    return value


def positive_float(text: str) -> float:
    """A positive finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value}")
    return value


def _a(name: str) -> str:
    """``name`` with its indefinite article: ``an EstimatorSettings``, ``a GameSettings``."""
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name
