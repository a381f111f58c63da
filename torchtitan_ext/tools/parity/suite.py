"""The engine: one seed checkpoint and one baseline run, compared with each test.

A single comparison (``run_parity``) is a suite of one test named ``test``.
"""

import dataclasses
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .compare import (
    DEFAULT_GRAD_NORM_TOL,
    DEFAULT_LOSS_TOL,
    Comparison,
    StepRow,
    Tolerance,
    compare,
    format_table,
    per_step_tolerances,
)
from .launch import RUN_TRAIN, RunRecord, RunSpec, launch_run, log_tail
from .moments import MomentComparison, compare_first_moments
from .report import jsonable, plot
from .scalars import GRAD_NORM_TAG, LOSS_TAG, ParityError, RunScalars, read_tb_scalars

__all__ = ["SEED", "ParityCase", "ParityResult", "run_parity", "run_parity_suite"]

SEED = 42

# The checkpoint folder of the seed run, relative to its dump folder; set
# explicitly so the seed's location does not depend on the job's config.
_SEED_CKPT_FOLDER = "checkpoint"
# A seed checkpoint must be made on one rank, unsharded; a job file may set
# parallelism degrees for its own world size, so they are reset for the seed.
_SEED_PARALLELISM = (
    "--parallelism.data_parallel_replicate_degree=1",
    "--parallelism.data_parallel_shard_degree=-1",
    "--parallelism.tensor_parallel_degree=1",
    "--parallelism.pipeline_parallel_degree=1",
    "--parallelism.context_parallel_degree=1",
    "--parallelism.expert_parallel_degree=1",
)
# Run names a suite's tests may not take: their logs and dump folders are shared.
_SHARED_RUN_NAMES = frozenset({"seed", "baseline"})
# A test's name becomes a folder and a log file name in the output dir.
_TEST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(slots=True)
class ParityCase:
    """One test of :func:`run_parity_suite`, with settings of its own.

    A field left ``None`` takes the suite's value: ``ParityCase(spec,
    exact=True)`` is compared bit for bit in a suite that otherwise uses
    tolerances, ``ParityCase(spec, loss_tol=1e-3)`` within a looser bound
    (in an ``exact`` suite, also pass ``exact=False``: the tolerances apply
    only to a comparison that is not exact). ``steps`` trains fewer steps than
    the suite (compared over those). ``control`` names an earlier test of the
    suite that bounds this one after ``tight_steps`` (see ``run_parity_suite``).
    """

    spec: RunSpec
    _: dataclasses.KW_ONLY
    exact: bool | None = None
    loss_tol: float | None = None
    grad_norm_tol: float | None = None
    moment_tol: float | None = None
    steps: int | None = None
    tight_steps: int | None = None
    control: str | None = None
    control_factor: float | None = None


# Everything of a ParityCase but its spec: what a test inherits from its suite.
_SETTING_FIELDS = tuple(f for f in dataclasses.fields(ParityCase) if f.name != "spec")


@dataclass(kw_only=True, slots=True)
class ParityResult:
    """Everything a caller needs to judge, and to find, one comparison.

    ``output_dir`` holds all runs of the suite; ``runs`` are the seed (if
    any), the baseline and the test, as far as they got. ``moments`` is the
    first-moment comparison when the suite makes one, ``checkpoint`` the
    test's saved state it read.
    """

    passed: bool
    rows: list[StepRow]
    max_dloss: float | None
    max_dgrad_norm: float | None
    failures: list[str]
    runs: list[RunRecord]
    output_dir: Path
    json_path: Path
    png_path: Path | None
    baseline: RunScalars | None = None
    test: RunScalars | None = None
    moments: MomentComparison | None = None
    checkpoint: Path | None = None


def _describe(case: ParityCase) -> str:
    """A resolved case's bounds, for the verdict line."""
    if case.exact:
        return "exact"
    text = f"loss_tol={case.loss_tol:g}, grad_norm_tol={case.grad_norm_tol:g}"
    if case.tight_steps is not None and case.control is not None:
        text += (
            f" over steps 1..{case.tight_steps}, then {case.control_factor:g} x "
            f"{case.control}'s running max"
        )
    if case.moment_tol is not None:
        text += f", first moments {case.moment_tol:g}"
    return text


def _step_tolerances(
    case: ParityCase, control_rows: list[StepRow] | None
) -> tuple[Tolerance, Tolerance]:
    """A resolved case's tight bounds at every step, or per step from its control."""
    if case.tight_steps is None or case.control is None:
        return case.loss_tol, case.grad_norm_tol
    return per_step_tolerances(
        loss_tol=case.loss_tol,
        grad_norm_tol=case.grad_norm_tol,
        steps=case.steps,
        tight_steps=case.tight_steps,
        control=control_rows or [],
        control_factor=case.control_factor,
    )


def _settings(case: ParityCase) -> dict[str, Any]:
    return {f.name: getattr(case, f.name) for f in _SETTING_FIELDS}


@dataclass(kw_only=True, slots=True)
class _Session:
    """What every run of one suite shares: where it writes, how it launches."""

    out: Path
    steps: int
    run_train: str
    precision: list[str]
    timeout: float | None
    echo: bool
    seed_options: str
    seed_checkpoint: bool | Path
    keep_mixed_precision: bool
    moment_step: int | None
    # Flags that make a run start from the seed checkpoint; set by _make_seed.
    load_args: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def checkpoint_path(self, name: str) -> Path:
        """Where run ``name`` saved its state after ``moment_step``."""
        return self.out / name / _SEED_CKPT_FOLDER / f"step-{self.moment_step}"


@dataclass(kw_only=True, slots=True)
class _Baseline:
    """The seed and baseline runs, made once and compared against each test."""

    spec: RunSpec
    runs: list[RunRecord]
    failures: list[str]
    scalars: RunScalars | None
    wall_s: float


def _resolve_cases(
    tests: Mapping[str, RunSpec | ParityCase], suite: ParityCase
) -> dict[str, ParityCase]:
    """Every test as a ParityCase with the suite's values filled in, checked."""
    if not tests:
        raise ValueError("a parity suite needs at least one test")
    cases: dict[str, ParityCase] = {}
    for name, value in tests.items():
        if not isinstance(name, str) or not _TEST_NAME.fullmatch(name):
            raise ValueError(
                f"test name {name!r} must match {_TEST_NAME.pattern} "
                "(it names a folder and a log file)"
            )
        if name in _SHARED_RUN_NAMES:
            raise ValueError(f"test name {name!r} is taken by the shared runs")
        if isinstance(value, RunSpec):
            value = ParityCase(value)
        elif not isinstance(value, ParityCase):
            raise TypeError(
                f"test {name!r}: expected a RunSpec or ParityCase, "
                f"got {type(value).__name__}"
            )
        inherited = {
            f.name: getattr(suite, f.name)
            for f in _SETTING_FIELDS
            if getattr(value, f.name) is None
        }
        case = dataclasses.replace(value, **inherited)
        if not 1 <= case.steps <= suite.steps:
            raise ValueError(
                f"test {name!r}: steps={case.steps} must be in 1..{suite.steps} "
                "(the baseline's steps)"
            )
        if case.control is not None:
            if case.control not in cases:
                raise ValueError(
                    f"test {name!r}: control {case.control!r} must be an earlier "
                    f"test of the suite; earlier tests: {list(cases)}"
                )
            if cases[case.control].steps < case.steps:
                raise ValueError(
                    f"test {name!r}: its control {case.control!r} trains "
                    f"{cases[case.control].steps} steps, fewer than its {case.steps}"
                )
        cases[name] = case
    return cases


def _start(
    *,
    output_dir: str | os.PathLike[str] | None,
    steps: int,
    launcher: str | os.PathLike[str] | None,
    timeout: float | None,
    echo: bool,
    seed_options: str,
    seed_checkpoint: bool | str | os.PathLike[str],
    keep_mixed_precision: bool,
    moment_step: int | None,
) -> _Session:
    """Check the arguments and create the (new or empty) output dir."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if moment_step is not None and not 1 <= moment_step <= steps:
        raise ValueError(f"moment_step={moment_step} must be in 1..steps ({steps})")
    if output_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        output_dir = Path("outputs") / "parity" / stamp
    out = Path(output_dir).resolve()
    if out.exists() and any(out.iterdir()):
        # Stale checkpoints would be resumed, stale TB runs compared.
        raise ValueError(f"output dir {out} exists and is not empty")
    if not isinstance(seed_checkpoint, bool):
        seed_checkpoint = Path(seed_checkpoint).resolve()
        if not (seed_checkpoint / ".metadata").is_file() and not _is_hf(
            seed_checkpoint
        ):
            raise ValueError(
                f"seed_checkpoint {seed_checkpoint} is neither a DCP checkpoint "
                "(no .metadata) nor a Hugging Face one (no config.json and "
                "*.safetensors); pass a step folder, e.g. <dump>/checkpoint/step-0"
            )
    out.mkdir(parents=True, exist_ok=True)
    return _Session(
        out=out,
        steps=steps,
        run_train=str(Path(launcher).resolve() if launcher else RUN_TRAIN),
        precision=(
            []
            if keep_mixed_precision
            else ["--training.mixed_precision_param", "float32"]
        ),
        timeout=timeout,
        echo=echo,
        seed_options=seed_options,
        seed_checkpoint=seed_checkpoint,
        keep_mixed_precision=keep_mixed_precision,
        moment_step=moment_step,
    )


def _launch(s: _Session, name: str, job_env: dict[str, str], argv: list[str]):
    record = launch_run(
        name, job_env, argv, s.out / f"{name}.log", timeout=s.timeout, echo=s.echo
    )
    if not record.ok:
        print(
            f"[parity] last lines of {record.log_path}:\n" + log_tail(record.log_path),
            file=sys.stderr,
            flush=True,
        )
    return record


def _make_seed(s: _Session, baseline: RunSpec) -> tuple[RunRecord, list[str]]:
    """Create the seed checkpoint on one rank; set ``s.load_args`` to load it."""
    seed_dump = s.out / "seed"
    argv = [
        s.run_train,
        f"--dump_folder={seed_dump}",
        *_SEED_PARALLELISM,
        *s.precision,
        *shlex.split(s.seed_options),
        "--checkpoint.create_seed_checkpoint",
        "--checkpoint.enable",
        f"--checkpoint.folder={_SEED_CKPT_FOLDER}",
        "--debug.deterministic",
        f"--debug.seed={SEED}",
    ]
    record = _launch(s, "seed", baseline.job_env(ngpu=1), argv)
    seed_path = seed_dump / _SEED_CKPT_FOLDER / "step-0"
    failures: list[str] = []
    if not record.ok:
        failures.append(record.failure())
    elif not (seed_path / ".metadata").is_file():
        failures.append(f"seed run succeeded but wrote no checkpoint at {seed_path}")
    s.load_args = _load_seed_args(seed_path)
    return record, failures


def _seed_json(s: _Session) -> dict[str, Any]:
    """The seed of a report: the options that made it, or the checkpoint loaded."""
    if isinstance(s.seed_checkpoint, Path):
        return {"seed_options": None, "seed_checkpoint": str(s.seed_checkpoint)}
    return {"seed_options": s.seed_options if s.seed_checkpoint else None}


def _is_hf(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _load_seed_args(seed_path: Path) -> list[str]:
    return [
        f"--checkpoint.initial_load_path={seed_path}",
        "--checkpoint.initial_load_model_only",
        *(["--checkpoint.initial_load_in_hf"] if _is_hf(seed_path) else []),
    ]


def _train(
    s: _Session, name: str, spec: RunSpec, steps: int
) -> tuple[RunRecord, RunScalars | None, list[str]]:
    """Train ``spec`` for ``steps`` steps into ``<out>/<name>``; read its scalars."""
    dump = s.out / name
    tb_folder = f"tb_{name}"
    if s.moment_step is None:
        # Load the seed, never save: nothing but the scalars is compared.
        checkpointing = ["--checkpoint.load_only"]
    else:
        # Full state after moment_step; the last step's save is the model only,
        # unless it is that step.
        checkpointing = [
            f"--checkpoint.folder={_SEED_CKPT_FOLDER}",
            f"--checkpoint.interval={s.moment_step}",
            "--checkpoint.no-last_save_model_only"
            if steps == s.moment_step
            else "--checkpoint.last_save_model_only",
        ]
    argv = [
        s.run_train,
        f"--dump_folder={dump}",
        *s.precision,
        *spec.option_args(),
        "--debug.deterministic",
        f"--debug.seed={SEED}",
        "--metrics.enable_tensorboard",
        "--metrics.log_freq=1",
        f"--training.steps={steps}",
        f"--metrics.save_tb_folder={tb_folder}",
        "--checkpoint.enable",
        *checkpointing,
        *s.load_args,
    ]
    record = _launch(s, name, spec.job_env(), argv)
    if not record.ok:
        return record, None, [record.failure()]
    try:
        return record, read_tb_scalars(dump / tb_folder), []
    except ParityError as e:
        return record, None, [f"{name}: {e}"]


def _run_baseline(s: _Session, baseline: RunSpec) -> _Baseline:
    """The seed (unless disabled) and the baseline run; stops at the first failure."""
    start = time.monotonic()
    runs: list[RunRecord] = []
    failures: list[str] = []
    scalars: RunScalars | None = None
    if isinstance(s.seed_checkpoint, Path):
        s.load_args = _load_seed_args(s.seed_checkpoint)
    elif s.seed_checkpoint:
        record, failures = _make_seed(s, baseline)
        runs.append(record)
    if not failures:
        record, scalars, failures = _train(s, "baseline", baseline, s.steps)
        runs.append(record)
    return _Baseline(
        spec=baseline,
        runs=runs,
        failures=failures,
        scalars=scalars,
        wall_s=time.monotonic() - start,
    )


def _run_record_json(record: RunRecord) -> dict[str, Any]:
    return {
        **dataclasses.asdict(record),
        **({} if record.ok else {"log_tail": log_tail(record.log_path)}),
    }


def _first_steps(scalars: RunScalars, steps: int) -> RunScalars:
    return RunScalars(
        loss={k: v for k, v in scalars.loss.items() if k <= steps},
        grad_norm={k: v for k, v in scalars.grad_norm.items() if k <= steps},
    )


def _run_test(
    s: _Session,
    base: _Baseline,
    name: str,
    case: ParityCase,
    control: "ParityResult | None",
) -> ParityResult:
    """Train one test (unless the baseline failed), compare it, write its report."""
    started = time.monotonic()
    failures = list(base.failures)
    runs = list(base.runs)
    scalars: RunScalars | None = None
    if not failures:
        record, scalars, run_failures = _train(s, name, case.spec, case.steps)
        runs.append(record)
        failures.extend(run_failures)
    if case.control is not None and (control is None or not control.rows):
        failures.append(
            f"control {case.control!r} has no comparison to bound the steps "
            f"after {case.tight_steps}"
        )
    comparison: Comparison | None = None
    moments: MomentComparison | None = None
    if not failures and base.scalars is not None and scalars is not None:
        comparison, moments = _judge(s, base, name, case, control, scalars)
        failures.extend(comparison.failures)
        failures.extend(moments.failures if moments else [])
    rows = comparison.rows if comparison else []
    result = ParityResult(
        passed=comparison is not None and not failures,
        rows=rows,
        max_dloss=comparison.max_dloss if comparison else None,
        max_dgrad_norm=comparison.max_dgrad_norm if comparison else None,
        failures=failures,
        runs=runs,
        output_dir=s.out,
        json_path=s.out / name / "parity.json",
        png_path=s.out / name / "parity.png" if rows else None,
        baseline=base.scalars,
        test=scalars,
        moments=moments,
        checkpoint=s.checkpoint_path(name) if moments else None,
    )
    _write_test_report(s, base, name, case, result, time.monotonic() - started)
    return result


def _judge(
    s: _Session,
    base: _Baseline,
    name: str,
    case: ParityCase,
    control: "ParityResult | None",
    scalars: RunScalars,
) -> tuple[Comparison, MomentComparison | None]:
    """The test's steps against the baseline's, and its first moments."""
    loss_tol, grad_norm_tol = _step_tolerances(case, control.rows if control else None)
    comparison = compare(
        _first_steps(base.scalars, case.steps),
        scalars,
        loss_tol=loss_tol,
        grad_norm_tol=grad_norm_tol,
        exact=case.exact,
        expected_steps=case.steps,
    )
    print(f"[parity] baseline vs {name}:\n{format_table(comparison)}", flush=True)
    if s.moment_step is None:
        return comparison, None
    moments = compare_first_moments(
        s.checkpoint_path("baseline"),
        s.checkpoint_path(name),
        tol=math.inf if case.moment_tol is None else case.moment_tol,
    )
    print(
        f"[parity] {name}: first moments after step {s.moment_step}: max "
        f"relative error {_fmt(moments.max_error)} over {len(moments.errors)} "
        f"tensors (bound {_fmt(case.moment_tol)})",
        flush=True,
    )
    return comparison, moments


def _maxima(result: "ParityResult") -> dict[str, float | None]:
    return {
        "max_dloss": result.max_dloss,
        "max_dgrad_norm": result.max_dgrad_norm,
        "max_moment_error": result.moments.max_error if result.moments else None,
    }


def _write_test_report(
    s: _Session,
    base: _Baseline,
    name: str,
    case: ParityCase,
    result: ParityResult,
    wall_s: float,
) -> None:
    """``<out>/<name>/parity.json`` (and ``parity.png``), and the verdict line."""
    result.json_path.parent.mkdir(parents=True, exist_ok=True)
    if result.png_path:
        title = f"parity: baseline vs {name}, {len(result.rows)} steps"
        plot(result.rows, result.png_path, title, name)
    summary = {
        "name": name,
        "passed": result.passed,
        "failures": result.failures,
        **_settings(case),
        "tags": {"loss": LOSS_TAG, "grad_norm": GRAD_NORM_TAG},
        **_maxima(result),
        "moments": (
            {"step": s.moment_step, **result.moments.summary()}
            if result.moments
            else None
        ),
        "baseline": dataclasses.asdict(base.spec),
        "test": dataclasses.asdict(case.spec),
        **_seed_json(s),
        "keep_mixed_precision": s.keep_mixed_precision,
        "runs": [_run_record_json(r) for r in result.runs],
        "per_step": [dataclasses.asdict(r) for r in result.rows],
        # The shared seed and baseline runs count in every test's time.
        "total_wall_s": base.wall_s + wall_s,
        "png": str(result.png_path) if result.png_path else None,
    }
    result.json_path.write_text(json.dumps(jsonable(summary), indent=2) + "\n")
    verdict = "PASSED" if result.passed else "FAILED"
    print(
        f"[parity] {name}: {verdict} ({_describe(case)}); summary: {result.json_path}",
        flush=True,
    )
    for failure in result.failures:
        print(f"[parity]   {failure}", flush=True)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3e}"


def run_parity_suite(
    baseline: RunSpec,
    tests: Mapping[str, RunSpec | ParityCase],
    *,
    steps: int = 10,
    seed_options: str = "",
    seed_checkpoint: bool | str | os.PathLike[str] = True,
    output_dir: str | os.PathLike[str] | None = None,
    loss_tol: float = DEFAULT_LOSS_TOL,
    grad_norm_tol: float = DEFAULT_GRAD_NORM_TOL,
    exact: bool = False,
    tight_steps: int | None = None,
    control_factor: float = 1.0,
    moment_step: int | None = None,
    moment_tol: float | None = None,
    keep_mixed_precision: bool = False,
    timeout: float | None = None,
    launcher: str | os.PathLike[str] | None = None,
    echo: bool = False,
) -> dict[str, ParityResult]:
    """Compare several tests with one baseline, trained once from one seed.

    The seed checkpoint (one rank, the baseline's job plus ``seed_options``,
    or the step folder ``seed_checkpoint`` names, so that suites share one)
    and the baseline are made once; each test then trains in order and is
    compared with the baseline. A test is a ``RunSpec`` or a
    :class:`ParityCase` whose non-``None`` fields override the suite's
    settings; names match ``[A-Za-z0-9][A-Za-z0-9_.-]*``, not ``seed`` or
    ``baseline``.

    Bounds: |dloss| <= ``loss_tol`` and |dgrad_norm| <= ``grad_norm_tol`` at
    every step, or (``exact``) no difference at all. A test with a ``control``
    (an earlier test of the suite, compared with the same baseline) is held to
    those bounds over steps 1..``tight_steps`` only; at a later step to
    ``control_factor`` times the control's largest difference so far, never
    less than the tight bounds: AdamW amplifies rounding with every step, and
    a run of the same math shows by how much. With ``moment_step`` every run
    saves its state after that step and each test's first moments must be
    within ``moment_tol`` of the baseline's, per parameter, relative to its
    largest entry (reported, not judged, when ``moment_tol`` is None).

    ``timeout``: per run (s); ``launcher``: instead of ``run_train.sh``;
    ``echo``: the runs' output to stdout; ``keep_mixed_precision``: the job's
    parameter dtype, not float32.

    ``output_dir``: ``seed/``, ``baseline/``, ``<name>/`` (dump, parity.json,
    parity.png), logs, ``suite.json``. A failed seed or baseline fails every
    test, a failed test only itself; nothing raises: see ``passed``.
    """
    suite = ParityCase(
        RunSpec(),
        exact=exact,
        loss_tol=loss_tol,
        grad_norm_tol=grad_norm_tol,
        moment_tol=moment_tol,
        steps=steps,
        tight_steps=tight_steps,
        control_factor=control_factor,
    )
    cases = _resolve_cases(tests, suite)
    short = [n for n, c in cases.items() if c.steps < (moment_step or 0)]
    if short:
        raise ValueError(f"tests {short} stop before moment_step={moment_step}")
    s = _start(
        output_dir=output_dir,
        steps=steps,
        launcher=launcher,
        timeout=timeout,
        echo=echo,
        seed_options=seed_options,
        seed_checkpoint=seed_checkpoint,
        keep_mixed_precision=keep_mixed_precision,
        moment_step=moment_step,
    )
    base = _run_baseline(s, baseline)
    results: dict[str, ParityResult] = {}
    for name, case in cases.items():
        results[name] = _run_test(s, base, name, case, results.get(case.control))
    _write_suite_summary(s, baseline, base, cases, results)
    return results


def _write_suite_summary(
    s: _Session,
    baseline: RunSpec,
    base: _Baseline,
    cases: dict[str, ParityCase],
    results: dict[str, ParityResult],
) -> None:
    """``<out>/suite.json`` and a line per test."""
    summary = {
        "passed": all(r.passed for r in results.values()),
        "steps": s.steps,
        "moment_step": s.moment_step,
        "baseline": dataclasses.asdict(baseline),
        **_seed_json(s),
        "keep_mixed_precision": s.keep_mixed_precision,
        "failures": base.failures,
        "runs": [_run_record_json(r) for r in base.runs],
        "tests": {
            name: {
                "passed": r.passed,
                **_maxima(r),
                **_settings(cases[name]),
                "failures": r.failures,
                "test": dataclasses.asdict(cases[name].spec),
                "wall_s": r.runs[-1].wall_s if len(r.runs) > len(base.runs) else None,
                "json": str(r.json_path),
                "png": str(r.png_path) if r.png_path else None,
            }
            for name, r in results.items()
        },
        "total_wall_s": time.monotonic() - s.started,
    }
    suite_path = s.out / "suite.json"
    suite_path.write_text(json.dumps(jsonable(summary), indent=2) + "\n")
    n_passed = sum(r.passed for r in results.values())
    print(
        f"[parity] suite: {n_passed}/{len(results)} passed; summary: {suite_path}",
        flush=True,
    )
    for name, r in results.items():
        moment = f", first moments {_fmt(r.moments.max_error)}" if r.moments else ""
        print(
            f"[parity]   {'PASSED' if r.passed else 'FAILED'} {name} "
            f"(max |dloss| {_fmt(r.max_dloss)}, "
            f"max |dgrad_norm| {_fmt(r.max_dgrad_norm)}{moment})",
            flush=True,
        )


def run_parity(
    baseline: RunSpec,
    test: RunSpec | None = None,
    *,
    loss_tol: float = DEFAULT_LOSS_TOL,
    grad_norm_tol: float = DEFAULT_GRAD_NORM_TOL,
    exact: bool = False,
    **suite_options,
) -> ParityResult:
    """Train ``baseline`` and ``test`` from one seed checkpoint and compare them.

    A suite of one test named ``test`` (its report is ``<output_dir>/test/``);
    ``test`` defaults to the baseline's job with no options. Other keyword
    arguments are :func:`run_parity_suite`'s.
    """
    if test is None:
        test = dataclasses.replace(baseline, options="")
    case = ParityCase(test, exact=exact, loss_tol=loss_tol, grad_norm_tol=grad_norm_tol)
    return run_parity_suite(baseline, {"test": case}, **suite_options)["test"]
