"""Words where figures alone would mislead: counts with the right plural ('1 group', '2 groups'), and
plots that cannot show a shape. A chart of one point, or of values that are all 0, reads as an empty
or broken figure (bars of height 0 are invisible; a line through one point is not drawn), so such a
plot carries a sentence in its middle that says what the data is. Used by the training report, its
plots and progress lines, `kiln eval` (chart, messages) and `kiln sft`'s loss plot."""

from __future__ import annotations

from collections.abc import Sequence


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """'1 group', '3 groups' ('1 attempt', '0 attempts'); `nouns` for an irregular plural."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def thin_data_note(points: Sequence[tuple[float, float]], *, unit: str = "step") -> str | None:
    """The sentence a plot of `points` ((x, value) pairs, over all its lines) needs, or None when they
    have a shape to show: one x only ('one step only (step 3): no trend to draw yet'), or every value 0."""
    if not points:
        return None
    xs = sorted({x for x, _ in points})
    zero = all(v == 0 for _, v in points)
    if len(xs) == 1:
        return f"one {unit} only ({unit} {xs[0]:g})" + (", and every value is 0" if zero else ": no trend to draw yet")
    return "every value is 0" if zero else None


def say_on(ax, text: str | None) -> None:
    """Write `text` across the middle of the axes (nothing when None)."""
    if text:
        ax.text(
            0.5,
            0.5,
            text,
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=10,
            color="#444444",
            bbox={"facecolor": "white", "edgecolor": "#bbbbbb", "alpha": 0.9},
        )
