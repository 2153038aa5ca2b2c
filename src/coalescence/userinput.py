"""What users hand us: JSON texts (input files, JSONL lines, RAG templates, tool-call arguments)
and the strings in them, checked so that every refusal is a one-line
:class:`~coalescence.errors.InputError` naming the field, never a Python traceback.

:func:`parse_json` refuses:

- syntax errors, with the line and column (``Expecting value at line 1 column 15``);
- nesting deeper than :data:`MAX_DEPTH` arrays/objects (Python's own parser would raise
  ``RecursionError`` near 1000 levels, and code that walks the value later could too);
- an integer literal longer than Python converts (``sys.get_int_max_str_digits()``, 4300 digits);
- a key given twice in one object (Python would silently keep the last value).

``NaN`` and ``Infinity`` literals are parsed as Python's ``json`` does (they are numbers, and every
number-valued input field takes an integer, so they are refused there by type).

:func:`check_text` refuses a string that is not Unicode text: a lone UTF-16 surrogate, which a JSON
escape such as ``"\\ud83d"`` without its low half produces, cannot be encoded as UTF-8 (for the
tokenizer, the snapshot id or the archive).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ConfigError, InputError

__all__ = ("MAX_DEPTH", "check_text", "closest", "did_you_mean", "parse_json", "refuse_misspelt_fields", "short_repr")

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects accepted (a chat input with tool calls needs 6 levels)."""


class _Refused(Exception):
    """Raised from inside the parser's hooks; becomes an InputError in :func:`parse_json`."""


def _pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(items)
    if len(obj) != len(items):
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                raise _Refused(f"the key {key!r} appears twice in one object; give each key once")
            seen.add(key)
    return obj


def _integer(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:  # longer than sys.get_int_max_str_digits()
        raise _Refused(
            f"an integer literal of {len(literal.lstrip('-'))} digits is longer than Python converts "
            "(sys.get_int_max_str_digits()); write it as a string"
        ) from None


def _position(exc: json.JSONDecodeError, *, with_line: bool) -> str:
    """``"<msg> at line L column C"`` without doubling a trailing "at" (``"starting at"``)."""
    where = f"line {exc.lineno} column {exc.colno}" if with_line else f"column {exc.colno}"
    return f"{exc.msg} {where}" if exc.msg.endswith(" at") else f"{exc.msg} at {where}"


def _depth_ok(value: Any) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def parse_json(text: str, *, what: str, field: str, single_line: bool = False) -> Any:
    """Parse a JSON text a user wrote.

    Args:
        text: the JSON text (already decoded; a leading BOM was removed by the caller).
        what: how to name the text in a message (``"conversation.json"``, ``"in.jsonl line 3"``).
        field: the error's field (``"input"``, ``"template"``, ...).
        single_line: the text is one line of a file (JSONL): errors give the column only.

    Returns:
        The parsed value (dicts, lists, str, int, float, bool, None).

    Raises:
        InputError: invalid JSON (with its position), nesting deeper than :data:`MAX_DEPTH`, an
            integer literal too long to convert, or a duplicate key in an object (``field``).
    """
    too_deep = False
    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_int=_integer)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} is not valid JSON: {_position(exc, with_line=not single_line)}", field=field) from None
    except _Refused as exc:
        raise InputError(f"{what}: {exc}", field=field) from None
    except RecursionError:  # Python's parser gives up near 1000 levels
        too_deep = True
    if too_deep or (isinstance(value, (dict, list)) and not _depth_ok(value)):
        raise InputError(
            f"{what} nests arrays and objects more than {MAX_DEPTH} levels deep; flatten the deepest value",
            field=field,
        )
    return value


def check_text(value: str, field: str, error: type[InputError] | type[ConfigError] = InputError) -> str:
    """Return ``value`` if it is Unicode text (encodable as UTF-8), else refuse it.

    Args:
        value: a string from the input or the command line.
        field: the field it came from (``"messages[1].content"``, ``"placeholder"``).
        error: the error raised: :class:`InputError` for the input, :class:`ConfigError` for a
            setting.

    Raises:
        InputError: (or ``error``) ``value`` holds a lone surrogate code point (``field``), with
            its position.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(
            f"holds a lone surrogate \\u{ord(value[exc.start]):04x} at character {exc.start}, which is not "
            "text; a JSON \\u escape of a character beyond U+FFFF needs both halves (\\ud83d\\ude00), or "
            "write the character itself",
            field=field,
        ) from None
    return value


def short_repr(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...``: a bad value quoted in a one-line
    message (a value of any size or depth the parser accepts)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def closest(name: object, names: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The known name ``name`` most likely stands for: the one equal to it ignoring case, else
    :func:`difflib.get_close_matches`' best at ``cutoff`` (its similarity ratio, 2M/T), or ``None``.

    The one "did you mean" of the package: methods, utilities, absence policies, units (the CLI's
    choices and the Python API alike), shapiq approximators and the input's fields.
    """
    if not isinstance(name, str):
        return None
    names = list(names)
    lowered = {n.lower(): n for n in names}
    if name.lower() in lowered:
        return lowered[name.lower()]
    found = difflib.get_close_matches(name, names, n=1, cutoff=cutoff)
    return found[0] if found else None


def did_you_mean(name: object, names: Iterable[str], *, prefix: str = "") -> str:
    """``" (did you mean X?)"`` for :func:`closest`'s answer (``prefix`` before X, e.g.
    ``"shapiq:"``), or ``""``: the hint an "unknown NAME" message ends with."""
    found = closest(name, names)
    return f" (did you mean {prefix}{found}?)" if found is not None and found != name else ""


FIELD_CUTOFF = 0.8
"""How close (difflib's ratio) an unknown input field must be to a known one to be refused as its
typo: ``targte``/``target`` 0.83, ``answr``/``answer`` 0.91; ``id``, ``source``, ``label`` are far."""


def refuse_misspelt_fields(data: Mapping[str, Any], known: Iterable[str], where: str = "") -> None:
    """Refuse a field of ``data`` that is no known field but a near miss of one (``targte`` for
    ``target``): an optional field ignored for a typo would silently change the run. Fields far
    from every known one, or made of a known one and more words (``question_id``), are metadata,
    kept out of the way as before.

    Args:
        data: an input object (the input, a document).
        known: its known fields.
        where: the object's path, prefixed to the field (``"documents[0]."``).

    Raises:
        InputError: naming the field and the known one it is close to.
    """
    known = tuple(known)
    for key in data:
        if not isinstance(key, str) or key in known:
            continue
        if any(part in known for part in re.split(r"[_\-. ]+", key)):
            continue  # a known field and more words: metadata about it (question_id, target_lang)
        found = closest(key, known, cutoff=FIELD_CUTOFF)
        if found is not None:
            raise InputError(
                f"unknown field; did you mean {found!r}? (known fields here: {', '.join(known)}; others are ignored)",
                field=f"{where}{key}",
            )
