"""Step-by-step comparison of two runs' loss and gradient norm."""

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .scalars import RunScalars

__all__ = [
    "DEFAULT_GRAD_NORM_TOL",
    "DEFAULT_LOSS_TOL",
    "Comparison",
    "StepRow",
    "Tolerance",
    "compare",
    "format_table",
    "per_step_tolerances",
]

DEFAULT_LOSS_TOL = 1e-5
DEFAULT_GRAD_NORM_TOL = 1e-4

Tolerance = float | Mapping[int, float]
"""One bound for every step, or a bound per step (every compared step needs one)."""


@dataclass(kw_only=True, slots=True)
class StepRow:
    """One step of the comparison table."""

    step: int
    baseline_loss: float
    test_loss: float
    dloss: float
    baseline_grad_norm: float
    test_grad_norm: float
    dgrad_norm: float


@dataclass(kw_only=True, slots=True)
class Comparison:
    """The verdict on two runs' scalars; ``failures`` says why it failed."""

    rows: list[StepRow]
    max_dloss: float | None
    max_dgrad_norm: float | None
    passed: bool
    failures: list[str]


def per_step_tolerances(
    *,
    loss_tol: float,
    grad_norm_tol: float,
    steps: int,
    tight_steps: int,
    control: list[StepRow],
    control_factor: float,
) -> tuple[dict[int, float], dict[int, float]]:
    """Bounds per step: tight over 1..tight_steps, then from a control comparison.

    AdamW turns rounding differences into differences of the update, and every
    step amplifies them, so a fixed bound at late steps is either blind or
    flaky. A run of the same math (a reordering only) shows how far rounding
    alone drifts: from step ``tight_steps + 1`` on, a step's bound is
    ``control_factor`` times the control's largest difference up to that step,
    never below the tight bound. Steps the control did not log get no bound,
    which ``compare`` reports as a failure.
    """
    by_step = {r.step: r for r in control}
    loss: dict[int, float] = {}
    grad_norm: dict[int, float] = {}
    control_loss = control_grad_norm = 0.0
    for step in range(1, steps + 1):
        if step in by_step:
            control_loss = max(control_loss, by_step[step].dloss)
            control_grad_norm = max(control_grad_norm, by_step[step].dgrad_norm)
        if step <= tight_steps:
            loss[step], grad_norm[step] = loss_tol, grad_norm_tol
        elif step in by_step:
            loss[step] = max(loss_tol, control_factor * control_loss)
            grad_norm[step] = max(grad_norm_tol, control_factor * control_grad_norm)
    return loss, grad_norm


def _diff(a: float, b: float) -> float:
    """|a - b|; infinite when either is not finite, which nothing can match."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b)


def _step_set_failures(
    baseline: RunScalars, test: RunScalars, expected_steps: int | None
) -> list[str]:
    failures: list[str] = []
    for metric in ("loss", "grad_norm"):
        b_steps = set(getattr(baseline, metric))
        t_steps = set(getattr(test, metric))
        if b_steps != t_steps:
            failures.append(
                f"{metric} step sets differ: only in baseline "
                f"{sorted(b_steps - t_steps)}, only in test {sorted(t_steps - b_steps)}"
            )
        if expected_steps is not None:
            want = set(range(1, expected_steps + 1))
            for side, got in (("baseline", b_steps), ("test", t_steps)):
                if got != want:
                    failures.append(
                        f"{side} logged {metric} for steps {sorted(got)}, "
                        f"expected 1..{expected_steps}"
                    )
    return failures


def _non_finite_failures(rows: list[StepRow]) -> list[str]:
    failures = []
    for r in rows:
        for name, value in (
            ("baseline loss", r.baseline_loss),
            ("test loss", r.test_loss),
            ("baseline grad_norm", r.baseline_grad_norm),
            ("test grad_norm", r.test_grad_norm),
        ):
            if not math.isfinite(value):
                failures.append(f"step {r.step}: {name} is {value!r}")
    return failures


def _tolerance_failures(rows: list[StepRow], metric: str, tol: Tolerance) -> list[str]:
    name = f"{metric}_tol"
    diffs = {r.step: getattr(r, f"d{metric}") for r in rows}
    if not isinstance(tol, Mapping):
        worst = max(diffs.values())
        if worst <= tol:
            return []
        return [f"max |d{metric}| {worst:.8e} > {name} {tol:.3e}"]
    failures = []
    for step, diff in diffs.items():
        if step not in tol:
            failures.append(f"step {step}: no {name} given for this step")
        elif not diff <= tol[step]:
            failures.append(
                f"step {step}: |d{metric}| {diff:.8e} > {name} {tol[step]:.3e}"
            )
    return failures


def compare(
    baseline: RunScalars,
    test: RunScalars,
    *,
    loss_tol: Tolerance = DEFAULT_LOSS_TOL,
    grad_norm_tol: Tolerance = DEFAULT_GRAD_NORM_TOL,
    exact: bool = False,
    expected_steps: int | None = None,
) -> Comparison:
    """Compare two runs step by step.

    With ``exact`` any difference fails; otherwise |dloss| must not exceed
    ``loss_tol`` nor |dgrad_norm| ``grad_norm_tol``, one bound for all steps or
    one per step (``{step: bound}``). A NaN or infinite
    value on either side fails (a diverged run is never "equal", not even to
    another diverged run), and so do different step sets, no steps at all, or
    (with ``expected_steps``) steps other than ``1..expected_steps``: a parity
    claim over missing steps is empty.
    """
    failures = _step_set_failures(baseline, test, expected_steps)
    steps = sorted(
        set(baseline.loss)
        & set(test.loss)
        & set(baseline.grad_norm)
        & set(test.grad_norm)
    )
    rows = [
        StepRow(
            step=s,
            baseline_loss=baseline.loss[s],
            test_loss=test.loss[s],
            dloss=_diff(baseline.loss[s], test.loss[s]),
            baseline_grad_norm=baseline.grad_norm[s],
            test_grad_norm=test.grad_norm[s],
            dgrad_norm=_diff(baseline.grad_norm[s], test.grad_norm[s]),
        )
        for s in steps
    ]
    if not rows:
        failures.append("no step was logged by both runs")
        return Comparison(
            rows=rows,
            max_dloss=None,
            max_dgrad_norm=None,
            passed=False,
            failures=failures,
        )

    failures.extend(_non_finite_failures(rows))
    max_dloss = max(r.dloss for r in rows)
    max_dgrad = max(r.dgrad_norm for r in rows)
    if exact:
        for r in rows:
            if r.dloss != 0.0:
                failures.append(
                    f"step {r.step}: loss differs: baseline {r.baseline_loss!r}, "
                    f"test {r.test_loss!r}"
                )
            if r.dgrad_norm != 0.0:
                failures.append(
                    f"step {r.step}: grad_norm differs: baseline "
                    f"{r.baseline_grad_norm!r}, test {r.test_grad_norm!r}"
                )
    else:
        failures.extend(_tolerance_failures(rows, "loss", loss_tol))
        failures.extend(_tolerance_failures(rows, "grad_norm", grad_norm_tol))
    return Comparison(
        rows=rows,
        max_dloss=max_dloss,
        max_dgrad_norm=max_dgrad,
        passed=not failures,
        failures=failures,
    )


def format_table(comparison: Comparison) -> str:
    """The per-step table and the maxima, with digits enough to see 1 ulp."""
    header = (
        f"{'step':>5}  {'baseline loss':>15}  {'test loss':>15}  {'|dloss|':>15}  "
        f"{'baseline grad_norm':>18}  {'test grad_norm':>18}  {'|dgrad_norm|':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in comparison.rows:
        lines.append(
            f"{r.step:>5}  {r.baseline_loss:>15.8e}  {r.test_loss:>15.8e}  "
            f"{r.dloss:>15.8e}  {r.baseline_grad_norm:>18.10f}  "
            f"{r.test_grad_norm:>18.10f}  {r.dgrad_norm:>15.8e}"
        )
    lines.append("-" * len(header))

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.8e}"

    lines.append(f"max |dloss|      = {fmt(comparison.max_dloss)}")
    lines.append(f"max |dgrad_norm| = {fmt(comparison.max_dgrad_norm)}")
    return "\n".join(lines)
