"""The report's diverging colour scale, centred at zero, and WCAG text contrast.

Values are coloured with ColorBrewer's RdBu (Brewer 2003; colour-blind safe), through matplotlib:
negative values red, positive values blue, zero the scale's neutral centre ``#f7f7f7``. The scale is
symmetric, ``[-M, +M]`` with ``M`` the largest absolute value shown, so the colour of a value
depends on its sign and its size, never on where the values happen to lie. By default it is
*robust*: when one value dwarfs the rest (the largest more than twice the 90th percentile ``K`` of
the absolute values), ``[0, K]`` takes the first 80% of the shades and ``[K, M]`` the last 20%, so
the many values below ``K`` stay apart and the largest is still the darkest; ``linear`` spreads
``[0, M]`` evenly. Text over a colour is black or white, whichever contrasts more by the WCAG 2 formula (its
ratio is then at least sqrt(21) ~ 4.58, above the AA threshold of 4.5 for normal text).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable

__all__ = ("CMAP", "KNEE_PERCENTILE", "KNEE_SHARE", "SCALES", "DivergingScale", "contrast_ratio", "neutral_color", "relative_luminance", "text_color")

CMAP = "RdBu"
"""The matplotlib colormap of the scale (red for negative, blue for positive values)."""
_LEVELS = 255  # odd: the middle level is the colormap's exact centre (``#f7f7f7`` for RdBu)
_BLACK, _WHITE = "#000000", "#ffffff"


@functools.cache
def _cmap() -> Any:
    """The colormap resampled to an odd number of levels (its middle level is its exact centre)."""
    return _matplotlib().colormaps[CMAP].resampled(_LEVELS)


def _matplotlib() -> Any:
    """matplotlib, or an error with the install command when it is missing."""
    try:
        import matplotlib
        import matplotlib.colors
    except ImportError as exc:
        raise BackendUnavailable(
            "the HTML report draws with matplotlib, which is not installed; install the report extra: "
            "pip install -c constraints.txt -e '.[report]' (or pip install matplotlib)",
            field="report",
        ) from exc
    return matplotlib


def relative_luminance(color: str) -> float:
    """The WCAG 2 relative luminance of an sRGB colour ``#rrggbb``.

    Each channel c in [0, 1] is linearised (``c / 12.92`` if ``c <= 0.04045``, else
    ``((c + 0.055) / 1.055) ** 2.4``); ``L = 0.2126 R + 0.7152 G + 0.0722 B``.

    Returns:
        L in [0, 1] (0 for black, 1 for white).
    """
    rgb = [int(color[k : k + 2], 16) / 255 for k in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast_ratio(a: str, b: str) -> float:
    """The WCAG 2 contrast ratio ``(L1 + 0.05) / (L2 + 0.05)`` of two colours, L1 the lighter.

    Returns:
        A ratio in [1, 21]; WCAG AA asks at least 4.5 for normal text.
    """
    la, lb = relative_luminance(a), relative_luminance(b)
    return (max(la, lb) + 0.05) / (min(la, lb) + 0.05)


def text_color(background: str) -> str:
    """Black or white, whichever contrasts more with ``background`` (``#rrggbb``)."""
    return _BLACK if contrast_ratio(background, _BLACK) >= contrast_ratio(background, _WHITE) else _WHITE


SCALES = ("robust", "linear")
"""The report's colour scales (``report --scale``): ``robust`` (the default) and ``linear``."""

KNEE_PERCENTILE = 90
"""The robust scale's knee: this percentile of the absolute values (nearest rank)."""
KNEE_SHARE = 0.8
"""The share of the shades the robust scale gives to ``[0, knee]``."""


@dataclass(frozen=True, slots=True)
class DivergingScale:
    """A symmetric colour scale ``[-halfrange, +halfrange]`` centred at zero, linear, or with a knee.

    Args:
        halfrange: the largest absolute value of the scale (> 0, finite).
        knee: ``None`` (linear), or the absolute value (0 < knee < halfrange) below which the
            first ``KNEE_SHARE`` of the shades lie: ``|v| <= knee`` maps linearly to
            ``[0, KNEE_SHARE]``, ``knee <= |v| <= halfrange`` to ``[KNEE_SHARE, 1]``.

    Raises:
        ValueError: a halfrange that is not finite and positive, or a knee outside ``(0, halfrange)``.
    """

    halfrange: float
    knee: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.halfrange) and self.halfrange > 0):
            raise ValueError(f"halfrange must be finite and > 0, got {self.halfrange!r}")
        if self.knee is not None and not (math.isfinite(self.knee) and 0 < self.knee < self.halfrange):
            raise ValueError(f"knee must lie in (0, {self.halfrange}), got {self.knee!r}")

    @classmethod
    def for_values(cls, values: Iterable[float | None], scale: str = "robust") -> DivergingScale:
        """The scale of ``values``: half range the largest finite absolute value (1 if there is none
        or all are 0); with ``scale="robust"`` a knee at the 90th percentile of the nonzero absolute
        values (nearest rank) when the largest is more than twice it (else linear).

        Raises:
            ValueError: an unknown ``scale`` (one of :data:`SCALES`).
        """
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
        finite = sorted(abs(float(v)) for v in values if v is not None and math.isfinite(float(v)) and float(v) != 0)
        top = finite[-1] if finite else 0.0
        if top <= 0:
            return cls(1.0)
        if scale == "robust" and len(finite) >= 3:
            knee = finite[max(0, math.ceil(KNEE_PERCENTILE / 100 * len(finite)) - 1)]
            if 0 < knee and top > 2 * knee:
                return cls(top, knee)
        return cls(top)

    def fraction(self, value: float) -> float:
        """How far ``|value|`` goes towards the darkest shade, in [0, 1] (clipped)."""
        a = min(abs(float(value)), self.halfrange)
        if self.knee is None:
            return a / self.halfrange
        if a <= self.knee:
            return KNEE_SHARE * a / self.knee
        return KNEE_SHARE + (1 - KNEE_SHARE) * (a - self.knee) / (self.halfrange - self.knee)

    def position(self, value: float | None) -> float:
        """Where ``value`` lies on the colormap: 0 at ``-halfrange``, 0.5 at zero, 1 at ``+halfrange``
        (clipped; ``None`` or a non-finite value sits at the centre)."""
        if value is None or not math.isfinite(float(value)):
            return 0.5
        return 0.5 + math.copysign(0.5 * self.fraction(value), float(value))

    def color(self, value: float | None) -> str:
        """The background colour ``#rrggbb`` of ``value`` (the neutral centre for zero, ``None``, NaN)."""
        return str(_matplotlib().colors.to_hex(_cmap()(self.position(value))))

    def text_color(self, value: float | None) -> str:
        """The text colour (black or white) over :meth:`color` of ``value``."""
        return text_color(self.color(value))

    def value_at(self, position: float) -> float:
        """The value at ``position`` of the colormap (the inverse of :meth:`position`)."""
        f = min(1.0, abs(2 * float(position) - 1))
        if self.knee is None:
            a = f * self.halfrange
        elif f <= KNEE_SHARE:
            a = f / KNEE_SHARE * self.knee
        else:
            a = self.knee + (f - KNEE_SHARE) / (1 - KNEE_SHARE) * (self.halfrange - self.knee)
        return math.copysign(a, position - 0.5) if position != 0.5 else 0.0

    def stops(self, n: int = 9) -> list[tuple[float, str]]:
        """``n`` ``(value, colour)`` pairs at evenly spaced positions from ``-halfrange`` to
        ``+halfrange`` (a legend's gradient)."""
        return [(v, self.color(v)) for v in (self.value_at(k / (n - 1)) for k in range(n))]

    def ticks(self) -> list[tuple[float, float, bool]]:
        """``(value, position, labelled)`` of the legend's ticks: the ends and zero, labelled, and the
        knee's two marks, unlabelled (the legend's text gives the knee's value)."""
        ticks = [(-self.halfrange, 0.0, True), (0.0, 0.5, True), (self.halfrange, 1.0, True)]
        if self.knee is not None:
            ticks[1:1] = [(-self.knee, self.position(-self.knee), False)]
            ticks[3:3] = [(self.knee, self.position(self.knee), False)]
        return ticks

    def describe(self, unit: str, what: str = "|value|") -> str:
        """The scale in words, for the page (``what``: the quantity whose percentile is the knee)."""
        if self.knee is None:
            return f"linear from \u2212{_short(self.halfrange)} to +{_short(self.halfrange)} {unit}"
        return (
            f"linear up to \u00b1{_short(self.knee)} {unit} (the {KNEE_PERCENTILE}th percentile of {what}, "
            f"{round(100 * KNEE_SHARE)}% of the shades), compressed beyond to the largest, \u00b1{_short(self.halfrange)}"
        )


def _short(x: float) -> str:
    """Three significant digits (a legend tick)."""
    return f"{x:.3g}"


def neutral_color() -> str:
    """The colour of zero (the colormap's centre)."""
    return DivergingScale(1.0).color(0.0)
