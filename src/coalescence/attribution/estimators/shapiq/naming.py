"""Method names to estimator classes: ``shapiq:<Approximator>[:KEY=VALUE...]`` resolved against the
shapiq installed here or the external one, with the options written after the name."""

from __future__ import annotations

import functools
from typing import Any

from ....errors import ConfigError
from ...interactions import INTERACTION_INDICES
from ..base import Capabilities
from .estimator import ShapiqEstimator
from .external import ENV_PYTHON, NEWER_APPROXIMATORS, ExternalShapiq, external_shapiq
from .inprocess import _InProcess
from .library import PREFIX, _in_process_available, _shapiq

__all__ = ("approximator_estimator", "approximator_names")


def approximator_names() -> tuple[str, ...]:
    """The shapiq approximators a method can name, sorted: every Shapley-value and interaction
    approximator of the shapiq installed here, and those only an external shapiq
    (:func:`external_shapiq`) has.

    Raises:
        BackendUnavailable: shapiq is not installed here and no external shapiq is set up (with
            the install command).
    """
    names = set(_InProcess.names()) if _in_process_available() else set()
    external = external_shapiq()
    if external is not None:
        names |= set(external.names())
    if not names:
        _shapiq()  # raises with the install command
    return tuple(sorted(names))


@functools.cache
def approximator_estimator(method: str) -> type:
    """The estimator class of ``method`` (``"shapiq:<Approximator>"``), made once per name: run by
    the shapiq installed here when it has the approximator, else by the external shapiq
    (:func:`external_shapiq`).

    Raises:
        ConfigError: not a shapiq method name, or an approximator no available shapiq has
            (``field="method"``, listing the ones there are, and for shapiq's newer approximators
            how to set up an external shapiq).
        BackendUnavailable: shapiq is not installed and no external shapiq is set up (with the
            install command); the external shapiq does not start or answer.
    """
    if not isinstance(method, str) or not method.startswith(PREFIX):
        raise ConfigError(f"{method!r} is not a shapiq method; write shapiq:<Approximator>", field="method")
    name, _, option_text = method[len(PREFIX) :].partition(":")
    runtime: _InProcess | ExternalShapiq | None = None
    if _in_process_available() and name in _InProcess.names():
        runtime = _InProcess()
    else:
        external = external_shapiq()
        if external is not None and name in external.names():
            runtime = external
    if runtime is None:
        names = approximator_names()
        hint = ""
        if name in NEWER_APPROXIMATORS and external_shapiq() is None:
            import sys

            hint = (
                f" ({name} is in shapiq 1.5 and later, which need Python 3.12 or newer; this Python is "
                f"{sys.version_info.major}.{sys.version_info.minor}: set {ENV_PYTHON} to a Python >= 3.12 that has "
                f"shapiq, e.g. the one `make install` sets up in .venv-shapiq)"
            )
        if not hint:
            from ....userinput import did_you_mean

            hint = did_you_mean(name, names, prefix="shapiq:")
        raise ConfigError(f"shapiq has no approximator {name!r}{hint}; choose one of: {', '.join(names)}", field="method")
    valid, params = runtime.describe(name)
    fixed = _parse_options(method, name, option_text, params)
    indices = tuple(i for i in INTERACTION_INDICES if i in valid)
    capabilities = Capabilities(needs_budget=True, reports_stderr=False, interaction_indices=indices)
    return type(
        f"Shapiq{name}",
        (ShapiqEstimator,),
        {
            "name": method,
            "approximator": name,
            "runtime": runtime,
            "fixed_options": fixed,
            "capabilities": capabilities,
            "__slots__": (),
        },
    )


_SET_BY_THE_ADAPTER = frozenset({"self", "n", "random_state", "index", "max_order", "kwargs", "_args", "_kwargs", "args"})


def _parse_options(method: str, name: str, text: str, params: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """The constructor options written after the approximator's name, ``key=value`` separated by
    ``:`` (``shapiq:RegressionMSR:proxy_model=linear:k_folds=5``): values ``true``/``false``/
    ``none``, integers and floats as such, anything else a string.

    Raises:
        ConfigError: a malformed option, or a name that is not a constructor parameter the method
            may set (``field="method"``, naming the ones it may).
    """
    if not text:
        return ()
    allowed = [p for p in params if p not in _SET_BY_THE_ADAPTER]
    options: dict[str, Any] = {}
    for item in text.split(":"):
        key, eq, raw = item.partition("=")
        if not eq or not key or not raw:
            raise ConfigError(f"{method}: write options as {PREFIX}{name}:KEY=VALUE[:KEY=VALUE], got {item!r}", field="method")
        if key not in allowed:
            raise ConfigError(f"{method}: {name} takes no option {key!r}; it takes {', '.join(allowed) or 'none'}", field="method")
        lowered = raw.lower()
        value: Any = {"true": True, "false": False, "none": None}.get(lowered, raw)
        if value is raw:
            for convert in (int, float):
                try:
                    value = convert(raw)
                    break
                except ValueError:
                    continue
        options[key] = value
    return tuple(sorted(options.items()))
