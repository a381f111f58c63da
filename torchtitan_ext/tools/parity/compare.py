"""Two runs' per-step loss and gradient norm: read from TensorBoard, compared."""

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# The tags torchtitan's ``MetricsProcessor.log`` writes.
LOSS_TAG = "loss_metrics/global_avg_loss"
GRAD_NORM_TAG = "grad_norm"
TAGS = {"loss": LOSS_TAG, "grad_norm": GRAD_NORM_TAG}  # by RunScalars field
DEFAULT_LOSS_TOL = 1e-5
DEFAULT_GRAD_NORM_TOL = 1e-4
_METRICS = ("loss", "grad_norm")

# One bound for every step, or a bound per step (every compared step needs one).
Tolerance = float | Mapping[int, float]


class ParityError(RuntimeError):
    """A run's outputs cannot be compared (no TensorBoard run, missing tags)."""


@dataclass(kw_only=True, slots=True)
class RunScalars:
    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)


def read_tb_scalars(tb_folder: str | os.PathLike[str]) -> RunScalars:
    """Loss and grad_norm per step from ``<dump_folder>/<save_tb_folder>``, whose
    one ``<YYYYmmdd-HHMM>`` run folder must be alone, or a stale run could count."""
    root = Path(tb_folder)
    if not root.is_dir():
        raise ParityError(f"TensorBoard folder does not exist: {root}")
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    if len(runs) != 1:
        found = ", ".join(p.name for p in runs) or "none"
        raise ParityError(
            f"expected exactly one TensorBoard run directory in {root}, "
            f"found {len(runs)}: {found}"
        )
    # size_guidance 0 keeps every event: the default samples scalars.
    acc = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    values = {}
    for metric, tag in TAGS.items():
        if tag not in tags:
            raise ParityError(
                f"scalar tag {tag!r} not found in {runs[0]}; available: {tags}"
            )
        # A step logged twice keeps its last value, as TensorBoard shows it.
        values[metric] = {e.step: e.value for e in acc.Scalars(tag)}
    return RunScalars(**values)


@dataclass(kw_only=True, slots=True)
class StepRow:
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

    rows: list[StepRow] = field(default_factory=list)
    max_dloss: float | None = None
    max_dgrad_norm: float | None = None
    passed: bool = False
    failures: list[str] = field(default_factory=list)


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

    AdamW amplifies rounding differences with every step, so a fixed bound at
    late steps is either blind or flaky. A run of the same math (a reordering
    only) shows how far rounding alone drifts: from step ``tight_steps + 1`` on,
    a bound is ``control_factor`` times the control's largest difference so far,
    never below the tight one; a step the control did not log gets none (fails).
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
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def _step_set_failures(
    baseline: RunScalars, test: RunScalars, expected_steps: int | None
) -> list[str]:
    failures: list[str] = []
    for metric in _METRICS:
        b_steps, t_steps = set(getattr(baseline, metric)), set(getattr(test, metric))
        if b_steps != t_steps:
            failures.append(
                f"{metric} step sets differ: only in baseline "
                f"{sorted(b_steps - t_steps)}, only in test {sorted(t_steps - b_steps)}"
            )
        for side, got in (("baseline", b_steps), ("test", t_steps)):
            if expected_steps is not None and got != set(range(1, expected_steps + 1)):
                failures.append(
                    f"{side} logged {metric} for steps {sorted(got)}, "
                    f"expected 1..{expected_steps}"
                )
    return failures


def _tolerance_failures(rows: list[StepRow], metric: str, tol: Tolerance) -> list[str]:
    name = f"{metric}_tol"
    diffs = {r.step: getattr(r, f"d{metric}") for r in rows}
    if not isinstance(tol, Mapping):
        worst = max(diffs.values(), default=0.0)
        if worst <= tol:
            return []
        return [f"max |d{metric}| {worst:.8e} > {name} {tol:.3e}"]
    return [
        f"step {step}: no {name} given for this step"
        if step not in tol
        else f"step {step}: |d{metric}| {diff:.8e} > {name} {tol[step]:.3e}"
        for step, diff in diffs.items()
        if step not in tol or not diff <= tol[step]
    ]


def compare(
    baseline: RunScalars,
    test: RunScalars,
    *,
    loss_tol: Tolerance = DEFAULT_LOSS_TOL,
    grad_norm_tol: Tolerance = DEFAULT_GRAD_NORM_TOL,
    exact: bool = False,
    expected_steps: int | None = None,
) -> Comparison:
    """Compare two runs step by step: with ``exact`` any difference fails.

    A NaN or inf fails (diverged runs are never "equal", not even to each other),
    and so do different step sets, no steps at all, or (with ``expected_steps``)
    steps other than ``1..expected_steps``: a parity claim over missing steps is
    empty.
    """
    failures = _step_set_failures(baseline, test, expected_steps)
    b, t = baseline, test
    steps = set(b.loss) & set(t.loss) & set(b.grad_norm) & set(t.grad_norm)
    rows = [
        StepRow(
            step=s,
            baseline_loss=b.loss[s],
            test_loss=t.loss[s],
            dloss=_diff(b.loss[s], t.loss[s]),
            baseline_grad_norm=b.grad_norm[s],
            test_grad_norm=t.grad_norm[s],
            dgrad_norm=_diff(b.grad_norm[s], t.grad_norm[s]),
        )
        for s in sorted(steps)
    ]
    if not rows:
        failures.append("no step was logged by both runs")
    failures += [
        f"step {r.step}: {side} {metric} is {value!r}"
        for r in rows
        for metric in _METRICS
        for side in ("baseline", "test")
        if not math.isfinite(value := getattr(r, f"{side}_{metric}"))
    ]
    if exact:
        failures += [
            f"step {r.step}: {m} differs: baseline {getattr(r, f'baseline_{m}')!r}, "
            f"test {getattr(r, f'test_{m}')!r}"
            for r in rows
            for m in _METRICS
            if getattr(r, f"d{m}") != 0.0
        ]
    else:
        failures += _tolerance_failures(rows, "loss", loss_tol)
        failures += _tolerance_failures(rows, "grad_norm", grad_norm_tol)
    return Comparison(
        rows=rows,
        max_dloss=max((r.dloss for r in rows), default=None),
        max_dgrad_norm=max((r.dgrad_norm for r in rows), default=None),
        passed=not failures,
        failures=failures,
    )


def format_table(comparison: Comparison) -> str:
    """The per-step table and the maxima, with digits enough to see 1 ulp."""
    header = (
        f"{'step':>5}  {'baseline loss':>15}  {'test loss':>15}  {'|dloss|':>15}  "
        f"{'baseline grad_norm':>18}  {'test grad_norm':>18}  {'|dgrad_norm|':>15}"
    )
    rule = "-" * len(header)
    lines = [header, rule]
    for r in comparison.rows:
        lines.append(
            f"{r.step:>5}  {r.baseline_loss:>15.8e}  {r.test_loss:>15.8e}  "
            f"{r.dloss:>15.8e}  {r.baseline_grad_norm:>18.10f}  "
            f"{r.test_grad_norm:>18.10f}  {r.dgrad_norm:>15.8e}"
        )
    lines.append(rule)
    for name in ("dloss", "dgrad_norm"):
        v = getattr(comparison, f"max_{name}")
        lines.append(
            f"max |{name}|".ljust(17) + f"= {'n/a' if v is None else f'{v:.8e}'}"
        )
    return "\n".join(lines)
