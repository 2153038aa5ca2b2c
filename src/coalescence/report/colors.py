"""The report's diverging colour scale, centred at zero, and WCAG text contrast.

Values are coloured with ColorBrewer's RdBu (Brewer 2003; colour-blind safe), through matplotlib:
negative values red, positive values blue, zero the scale's neutral centre ``#f7f7f7``. The scale is
symmetric, ``[-M, +M]`` with ``M`` the largest absolute value shown, so the colour of a value
depends on its sign and its size relative to the largest one, never on where the values happen to
lie. Text over a colour is black or white, whichever contrasts more by the WCAG 2 formula (its
ratio is then at least sqrt(21) ~ 4.58, above the AA threshold of 4.5 for normal text).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable

__all__ = ("CMAP", "DivergingScale", "contrast_ratio", "neutral_color", "relative_luminance", "text_color")

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


@dataclass(frozen=True, slots=True)
class DivergingScale:
    """A symmetric colour scale ``[-halfrange, +halfrange]`` centred at zero.

    Args:
        halfrange: the largest absolute value of the scale (> 0, finite).

    Raises:
        ValueError: a halfrange that is not finite and positive.
    """

    halfrange: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.halfrange) and self.halfrange > 0):
            raise ValueError(f"halfrange must be finite and > 0, got {self.halfrange!r}")

    @classmethod
    def for_values(cls, values: Iterable[float | None]) -> DivergingScale:
        """The scale whose half range is the largest finite absolute value (1 if there is none or all are 0)."""
        finite = [abs(float(v)) for v in values if v is not None and math.isfinite(float(v))]
        top = max(finite, default=0.0)
        return cls(top if top > 0 else 1.0)

    def position(self, value: float | None) -> float:
        """Where ``value`` lies on the colormap: 0 at ``-halfrange``, 0.5 at zero, 1 at ``+halfrange``
        (clipped; ``None`` or a non-finite value sits at the centre)."""
        if value is None or not math.isfinite(float(value)):
            return 0.5
        return min(1.0, max(0.0, 0.5 + 0.5 * float(value) / self.halfrange))

    def color(self, value: float | None) -> str:
        """The background colour ``#rrggbb`` of ``value`` (the neutral centre for zero, ``None``, NaN)."""
        return str(_matplotlib().colors.to_hex(_cmap()(self.position(value))))

    def text_color(self, value: float | None) -> str:
        """The text colour (black or white) over :meth:`color` of ``value``."""
        return text_color(self.color(value))

    def stops(self, n: int = 9) -> list[tuple[float, str]]:
        """``n`` evenly spaced ``(value, colour)`` pairs from ``-halfrange`` to ``+halfrange`` (for a legend)."""
        return [(self.halfrange * (2 * k / (n - 1) - 1), self.color(self.halfrange * (2 * k / (n - 1) - 1))) for k in range(n)]


def neutral_color() -> str:
    """The colour of zero (the colormap's centre)."""
    return DivergingScale(1.0).color(0.0)
