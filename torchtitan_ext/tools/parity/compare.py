"""Two runs compared: per-step loss and grad_norm from TensorBoard, and every
parameter's AdamW first moment from their checkpoints.

The loss and the grad norm are two scalars: a bug that moves a few parameters'
gradients (one image's rows, one module's reduction) can hide in them. The first
moment after step ``n`` is a decayed sum of the first ``n`` gradients, and DCP
stores it per parameter at any world size."""

import functools
import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# The tags torchtitan's ``MetricsProcessor.log`` writes.
LOSS_TAG = "loss_metrics/global_avg_loss"
GRAD_NORM_TAG = "grad_norm"
TAGS = {"loss": LOSS_TAG, "grad_norm": GRAD_NORM_TAG}  # by RunScalars field
DEFAULT_LOSS_TOL = 1e-5
DEFAULT_GRAD_NORM_TOL = 1e-4
_FIRST_MOMENT = ".exp_avg"

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


@dataclass(slots=True)
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
    """Bounds per step: tight to ``tight_steps``, then ``control_factor`` times a
    same-math control's largest difference so far, never below the tight one (README:
    "How parity is checked" says why); a step the control did not log gets none."""
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


def _tolerance_failures(rows: list[StepRow], metric: str, tol: Tolerance) -> list[str]:
    name = f"{metric}_tol"
    diffs = {r.step: getattr(r, f"d{metric}") for r in rows}
    if not isinstance(tol, Mapping):
        worst = max(diffs.values(), default=0.0)
        return (
            [] if worst <= tol else [f"max |d{metric}| {worst:.8e} > {name} {tol:.3e}"]
        )
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

    A NaN or inf fails (diverged runs are never "equal", not even to each other), and
    so do different step sets, no steps at all, or (with ``expected_steps``) steps
    other than ``1..expected_steps``: a parity claim over missing steps is empty."""
    b, t = baseline, test
    failures = []
    for metric in TAGS:
        b_steps, t_steps = set(getattr(b, metric)), set(getattr(t, metric))
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
    rows = []
    for s in sorted(set(b.loss) & set(t.loss) & set(b.grad_norm) & set(t.grad_norm)):
        loss, grad_norm = (b.loss[s], t.loss[s]), (b.grad_norm[s], t.grad_norm[s])
        rows.append(StepRow(s, *loss, _diff(*loss), *grad_norm, _diff(*grad_norm)))
    if not rows:
        failures.append("no step was logged by both runs")
    failures += [
        f"step {r.step}: {side} {metric} is {value!r}"
        for r in rows
        for metric in TAGS
        for side in ("baseline", "test")
        if not math.isfinite(value := getattr(r, f"{side}_{metric}"))
    ]
    if exact:
        failures += [
            f"step {r.step}: {m} differs: baseline {getattr(r, f'baseline_{m}')!r}, "
            f"test {getattr(r, f'test_{m}')!r}"
            for r in rows
            for m in TAGS
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
    rows = [
        f"{r.step:>5}  {r.baseline_loss:>15.8e}  {r.test_loss:>15.8e}  "
        f"{r.dloss:>15.8e}  {r.baseline_grad_norm:>18.10f}  "
        f"{r.test_grad_norm:>18.10f}  {r.dgrad_norm:>15.8e}"
        for r in comparison.rows
    ]
    maxima = {"dloss": comparison.max_dloss, "dgrad_norm": comparison.max_dgrad_norm}
    footer = [
        f"max |{name}|".ljust(17) + f"= {'n/a' if v is None else f'{v:.8e}'}"
        for name, v in maxima.items()
    ]
    rule = "-" * len(header)
    return "\n".join([header, rule, *rows, rule, *footer])


def checkpoint_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A DCP checkpoint (any world size) as ``{dotted.key: tensor}``; not cached,
    as a caller may compare checkpoints it rewrites."""
    reader = dcp.FileSystemReader(path)
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


@dataclass(kw_only=True, slots=True)
class MomentComparison:
    """Per first moment: max |test - baseline| / max |baseline| of the tensor."""

    errors: dict[str, float]
    tol: float
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def max_error(self) -> float | None:
        return max(self.errors.values(), default=None)

    def summary(self, worst: int = 5) -> dict:
        errors = self.errors.values()
        ranked = sorted(self.errors.items(), key=lambda item: -item[1])
        return {
            "tol": self.tol,
            "tensors": len(self.errors),
            "max_error": self.max_error,
            "median_error": statistics.median(errors) if errors else None,
            "worst": dict(ranked[:worst]),
            "passed": self.passed,
            "failures": self.failures,
        }


@functools.lru_cache(maxsize=8)
def _first_moments(path: Path) -> dict[str, torch.Tensor]:
    """Cached: a suite's baseline is read once for all its tests."""
    return {
        k: v for k, v in checkpoint_tensors(path).items() if k.endswith(_FIRST_MOMENT)
    }


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    error = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return 0.0 if error == 0.0 else error / scale if scale > 0 else math.inf


def compare_first_moments(
    baseline_checkpoint: Path, test_checkpoint: Path, *, tol: float
) -> MomentComparison:
    """Every parameter's first moment in ``test`` within ``tol`` of ``baseline``'s.

    Relative to the baseline tensor's largest entry, so the bound means the same for
    large and small parameters; a non-finite moment, a moment present on one side
    only, or no moment at all fails."""
    ref, got = _first_moments(baseline_checkpoint), _first_moments(test_checkpoint)
    failures = []
    if not ref:
        failures.append(f"no first moments ({_FIRST_MOMENT}) in {baseline_checkpoint}")
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    if missing or extra:
        failures.append(
            f"first moments differ in keys: only in baseline {missing[:5]}, "
            f"only in test {extra[:5]}"
        )
    errors = {k: _relative_error(got[k], ref[k]) for k in sorted(ref) if k in got}
    over = sorted(((e, k) for k, e in errors.items() if not e <= tol), reverse=True)
    for error, key in over[:5]:
        failures.append(f"first moment {key}: relative error {error:.3e} > {tol:.3e}")
    if len(over) > 5:
        failures.append(f"... and {len(over) - 5} more first moments over {tol:.3e}")
    return MomentComparison(errors=errors, tol=tol, failures=failures)
