"""The date a chat template writes, pinned per renderer.

Dates. Templates that write today's date (Llama 3.1/3.2's ``Today Date``, through the
``strftime_now`` helper or the ``date_string`` variable) render under one pinned instant per
renderer (:attr:`ChatRenderer.now`): transformers passes extra ``apply_chat_template`` keyword
arguments to the template as variables, after converting them to plain data (a callable becomes
the text ``"<function>"``), so ``date_string`` is passed as a variable, and ``strftime_now`` is
shadowed by a Jinja macro put in front of the template (only of a template that names it) that
formats the pinned instant's fields, passed as a variable. :attr:`ChatRenderer.renders_date` says
whether the template's text changes with the date (rendered under two pinned dates, compared).
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

__all__ = ("DATE_PROBES", "DIRECTIVES", "STRFTIME_MACRO", "TODAY_ENV", "date_options", "template_now")

TODAY_ENV = "COALESCENCE_TODAY"
"""The environment variable that fixes "now" for chat templates that write the date: an ISO
date (``2024-07-26``, midnight) or date and time (``2024-07-26T09:30:00``). Unset: the clock."""

# strftime directives the pinned instant is formatted with (platform-independent ones)
DIRECTIVES = "aAbBcdfGHIjmMpSuUVwWxXyYzZ%"

STRFTIME_MACRO = (
    "{%- macro strftime_now(format) -%}"
    "{%- set ns = namespace(out='', pct=false) -%}"
    "{%- for ch in format -%}"
    "{%- if ns.pct -%}{%- set ns.out = ns.out + (coalescence_now[ch] if ch in coalescence_now else '%' + ch) -%}"
    "{%- set ns.pct = false -%}"
    "{%- elif ch == '%' -%}{%- set ns.pct = true -%}"
    "{%- else -%}{%- set ns.out = ns.out + ch -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ns.out -}}"
    "{%- endmacro %}"
)
"""Shadows transformers' ``strftime_now`` global: the same formatting, of the pinned instant."""

DATE_PROBES = (datetime(2001, 2, 3, 4, 5, 6), datetime(2002, 11, 12, 13, 14, 15))


def template_now() -> datetime:
    """The instant a new renderer pins: :data:`TODAY_ENV` when set, else the local clock (naive,
    as transformers' ``strftime_now``), to the second.

    Raises:
        ConfigError: :data:`TODAY_ENV` is set to something that is not an ISO date or datetime.
    """
    from ...errors import ConfigError

    raw = os.environ.get(TODAY_ENV)
    if raw is None or not raw.strip():
        return datetime.now().replace(microsecond=0)
    try:
        return datetime.fromisoformat(raw.strip()).replace(microsecond=0, tzinfo=None)
    except ValueError:
        raise ConfigError(f"must be an ISO date (2024-07-26) or datetime, got {raw!r}", field=TODAY_ENV) from None


def date_options(now: datetime, *, date_string: bool, source: str | None) -> dict[str, Any]:
    """The ``apply_chat_template`` options that render the date as ``now``.

    Args:
        now: the pinned instant.
        date_string: the template names the ``date_string`` variable (Llama 3.1's).
        source: the template's source with :data:`STRFTIME_MACRO` in front, for a template that
            names ``strftime_now``; ``None`` otherwise.

    Returns:
        Keyword arguments for ``apply_chat_template`` (empty for a template that writes no date).
    """
    options: dict[str, Any] = {}
    if date_string:
        options["date_string"] = now.strftime("%d %b %Y")  # Llama 3.1's variable and format
    if source is not None:
        options["chat_template"] = source
        options["coalescence_now"] = {c: now.strftime("%" + c) for c in DIRECTIVES}
    return options
