"""What a comparison leaves on disk: strict JSON and the parity plot."""

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after the headless backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .compare import StepRow  # noqa: E402

__all__ = ["jsonable", "plot"]


def jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become strings instead of bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _plot_differences(ax, steps: list[int], diffs: list[float], label: str) -> None:
    """|difference| per step on a log axis; exact zeros drawn at a visible floor."""
    finite = [d for d in diffs if d > 0 and math.isfinite(d)]
    floor = min(finite) / 10 if finite else 1e-12
    nonzero = [(s, d) for s, d in zip(steps, diffs, strict=True) if d > 0]
    zeros = [s for s, d in zip(steps, diffs, strict=True) if d == 0]
    if nonzero:
        ax.plot(
            [s for s, _ in nonzero],
            [d if math.isfinite(d) else 1e300 for _, d in nonzero],
            "o-",
            color="tab:red",
            label=label,
        )
    if zeros:
        ax.plot(
            zeros,
            [floor] * len(zeros),
            "s",
            color="tab:green",
            label=f"{label} = 0 exactly (drawn at {floor:.0e})",
        )
    ax.set_yscale("log")
    ax.set_ylabel(label)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)


def plot(rows: list[StepRow], path: Path, title: str, test_label: str = "test") -> None:
    """Loss curves, then |dloss| and |dgrad_norm| per step on log axes."""
    steps = [r.step for r in rows]
    fig, (ax_loss, ax_dloss, ax_dgrad) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax_loss.plot(steps, [r.baseline_loss for r in rows], "o-", label="baseline")
    ax_loss.plot(steps, [r.test_loss for r in rows], "x--", label=test_label)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(title)
    ax_loss.legend()
    ax_loss.grid(True, alpha=0.3)
    _plot_differences(ax_dloss, steps, [r.dloss for r in rows], "|dloss|")
    _plot_differences(ax_dgrad, steps, [r.dgrad_norm for r in rows], "|dgrad_norm|")
    ax_dgrad.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_dgrad.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
