"""The engine: one seed checkpoint and one baseline run, compared with each test.

Writes ``<output_dir>/<test>/parity.json`` and ``parity.png`` per test, and
``suite.json``; a single comparison (``run_parity``) is a suite of one test."""

import dataclasses
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
from matplotlib.ticker import MaxNLocator

from .compare import (
    DEFAULT_GRAD_NORM_TOL,
    DEFAULT_LOSS_TOL,
    TAGS,
    Comparison,
    MomentComparison,
    ParityError,
    RunScalars,
    compare,
    compare_first_moments,
    format_table,
    per_step_tolerances,
    read_tb_scalars,
)
from .launch import RUN_TRAIN, RunRecord, RunSpec, launch_run, log_tail

__all__ = ["ParityCase", "ParityResult", "run_parity", "run_parity_suite"]

_DETERMINISTIC = ["--debug.deterministic", "--debug.seed=42"]
_FP32 = ["--training.mixed_precision_param", "float32"]
# Every run's checkpoint folder, set so that the seed's path does not depend on
# the job's config.
_CKPT_FOLDER = "checkpoint"
# A seed checkpoint must be made on one rank, unsharded; a job file may set
# parallelism degrees for its own world size, so they are reset for the seed.
_SEED_PARALLELISM = """--parallelism.data_parallel_replicate_degree=1
--parallelism.data_parallel_shard_degree=-1 --parallelism.tensor_parallel_degree=1
--parallelism.pipeline_parallel_degree=1 --parallelism.context_parallel_degree=1
--parallelism.expert_parallel_degree=1""".split()
# A test's name becomes a folder and a log file name.
_TEST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(slots=True)
class ParityCase:
    """One test of a suite; a field left ``None`` takes the suite's value (a
    looser bound in an ``exact`` suite also needs ``exact=False``). ``control``:
    an earlier test whose differences bound this one after ``tight_steps``."""

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


# What a test inherits from its suite.
_SETTINGS = tuple(f.name for f in dataclasses.fields(ParityCase) if f.name != "spec")


@dataclass(kw_only=True, slots=True)
class ParityResult(Comparison):
    """A test's comparison and where it is: ``runs`` are the seed, baseline and
    test, as far as they got; ``checkpoint`` the test's state whose first
    moments were compared."""

    runs: list[RunRecord]
    output_dir: Path
    json_path: Path
    png_path: Path | None = None
    baseline: RunScalars | None = None
    test: RunScalars | None = None
    moments: MomentComparison | None = None
    checkpoint: Path | None = None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_hf(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@dataclass(kw_only=True, slots=True)
class _Suite:
    """The options of ``run_parity_suite``, checked, and the seed and baseline
    runs its tests share. A test passes with |dloss| <= ``loss_tol`` and
    |dgrad_norm| <= ``grad_norm_tol`` at every step, or (``exact``) no difference
    at all; a ``control`` bounds the steps after ``tight_steps``."""

    baseline: RunSpec
    steps: int = 10
    seed_options: str = ""  # extra flags of the seed run (the baseline's job)
    seed_checkpoint: bool | str | os.PathLike[str] = True  # or a step folder
    output_dir: str | os.PathLike[str] | None = None  # new or empty
    loss_tol: float = DEFAULT_LOSS_TOL
    grad_norm_tol: float = DEFAULT_GRAD_NORM_TOL
    exact: bool = False
    tight_steps: int | None = None
    control_factor: float = 1.0
    moment_step: int | None = None  # every run saves its state after it
    moment_tol: float | None = None  # max first-moment error; None: report only
    keep_mixed_precision: bool = False  # the job's parameter dtype, not float32
    timeout: float | None = None  # per run, s
    launcher: str | os.PathLike[str] | None = None  # instead of run_train.sh
    forked: bool = False  # on local_ranks' forked ranks instead of torchrun
    echo: bool = False  # the runs' output to stdout
    # Not options: what the seed and baseline runs leave for the tests.
    out: Path = field(init=False)
    load_args: list[str] = field(init=False, default_factory=list)
    runs: list[RunRecord] = field(init=False, default_factory=list)
    failures: list[str] = field(init=False, default_factory=list)
    scalars: RunScalars | None = field(init=False, default=None)  # the baseline's
    wall_s: float = field(init=False, default=0.0)  # of the seed and baseline
    started: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        _check(self.steps >= 1, f"steps must be at least 1, got {self.steps}")
        _check(
            self.moment_step is None or 1 <= self.moment_step <= self.steps,
            f"moment_step={self.moment_step} must be in 1..steps ({self.steps})",
        )
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.out = Path(self.output_dir or Path("outputs", "parity", stamp)).resolve()
        # Stale checkpoints would be resumed, stale TB runs compared.
        _check(
            not self.out.exists() or not any(self.out.iterdir()),
            f"output dir {self.out} exists and is not empty",
        )
        if not isinstance(self.seed_checkpoint, bool):
            seed = self.seed_checkpoint = Path(self.seed_checkpoint).resolve()
            _check(
                (seed / ".metadata").is_file() or _is_hf(seed),
                f"seed_checkpoint {seed} is neither a DCP checkpoint (no .metadata) "
                "nor a Hugging Face one (no config.json and *.safetensors); pass "
                "a step folder, e.g. <dump>/checkpoint/step-0",
            )
        self.launcher = str(Path(self.launcher or RUN_TRAIN).resolve())

    def shared_json(self, runs: list[RunRecord]) -> dict:
        seed = self.seed_checkpoint
        return {
            "baseline": asdict(self.baseline),
            "seed_options": self.seed_options if seed is True else None,
            **({"seed_checkpoint": seed} if isinstance(seed, Path) else {}),
            "keep_mixed_precision": self.keep_mixed_precision,
            "runs": [
                {**asdict(r), **({} if r.ok else {"log_tail": log_tail(r.log_path)})}
                for r in runs
            ],
        }


def _resolve_cases(
    tests: Mapping[str, RunSpec | ParityCase], s: _Suite
) -> dict[str, ParityCase]:
    """Every test as a ParityCase with the suite's values filled in, checked."""
    _check(bool(tests), "a parity suite needs at least one test")
    cases: dict[str, ParityCase] = {}
    for name, value in tests.items():
        _check(
            isinstance(name, str) and _TEST_NAME.fullmatch(name) is not None,
            f"test name {name!r} must match {_TEST_NAME.pattern} "
            "(it names a folder and a log file)",
        )
        _check(
            name not in ("seed", "baseline"),
            f"test name {name!r} is taken by the shared runs",
        )
        if isinstance(value, RunSpec):
            value = ParityCase(value)
        elif not isinstance(value, ParityCase):
            raise TypeError(
                f"test {name!r}: expected a RunSpec or ParityCase, "
                f"got {type(value).__name__}"
            )
        unset = {k: getattr(s, k, None) for k in _SETTINGS if getattr(value, k) is None}
        case = dataclasses.replace(value, **unset)
        _check(
            1 <= case.steps <= s.steps,
            f"test {name!r}: steps={case.steps} must be in 1..{s.steps} "
            "(the baseline's steps)",
        )
        if case.control is not None:
            _check(
                case.control in cases,
                f"test {name!r}: control {case.control!r} must be an earlier "
                f"test of the suite; earlier tests: {list(cases)}",
            )
            _check(
                cases[case.control].steps >= case.steps,
                f"test {name!r}: its control {case.control!r} trains "
                f"{cases[case.control].steps} steps, fewer than its {case.steps}",
            )
        cases[name] = case
    short = [n for n, c in cases.items() if c.steps < (s.moment_step or 0)]
    _check(not short, f"tests {short} stop before moment_step={s.moment_step}")
    return cases


def _launch(s: _Suite, name: str, job_env: dict[str, str], argv: list[str]):
    fp32 = [] if s.keep_mixed_precision else _FP32
    argv = [s.launcher, f"--dump_folder={s.out / name}", *fp32, *argv]
    log = s.out / f"{name}.log"
    record = launch_run(
        name, job_env, argv, log, timeout=s.timeout, echo=s.echo, forked=s.forked
    )
    if not record.ok:
        tail = log_tail(record.log_path)
        print(f"[parity] last lines of {log}:\n{tail}", file=sys.stderr, flush=True)
    return record


def _train(
    s: _Suite, name: str, spec: RunSpec, steps: int
) -> tuple[RunRecord, RunScalars | None, list[str]]:
    """Train ``spec`` for ``steps`` steps into ``<out>/<name>``; read its scalars."""
    if s.moment_step is None:
        # Load the seed, never save: nothing but the scalars is compared.
        checkpointing = "--checkpoint.load_only"
    else:
        # Full state after moment_step; the last step's save is the model only,
        # unless it is that step.
        last = "no-" if steps == s.moment_step else ""
        checkpointing = (
            f"--checkpoint.folder={_CKPT_FOLDER} --checkpoint.interval="
            f"{s.moment_step} --checkpoint.{last}last_save_model_only"
        )
    flags = (
        f"--metrics.enable_tensorboard --metrics.log_freq=1 --training.steps={steps}"
        f" --metrics.save_tb_folder=tb_{name} --checkpoint.enable {checkpointing}"
    )
    argv = [*spec.option_args(), *_DETERMINISTIC, *flags.split(), *s.load_args]
    record = _launch(s, name, spec.job_env(), argv)
    if not record.ok:
        return record, None, [record.failure()]
    try:
        return record, read_tb_scalars(s.out / name / f"tb_{name}"), []
    except ParityError as e:
        return record, None, [f"{name}: {e}"]


def _run_test(s: _Suite, name: str, case: ParityCase, control) -> ParityResult:
    """Train one test (unless the seed or baseline failed) and compare it."""
    r = ParityResult(
        failures=list(s.failures),
        runs=list(s.runs),
        output_dir=s.out,
        json_path=s.out / name / "parity.json",
        baseline=s.scalars,
    )
    if not r.failures:
        record, r.test, failures = _train(s, name, case.spec, case.steps)
        r.runs.append(record)
        r.failures += failures
    if case.control is not None and not (control and control.rows):
        r.failures.append(
            f"control {case.control!r} has no comparison to bound the steps "
            f"after {case.tight_steps}"
        )
    if r.failures:
        return r
    tols = {"loss_tol": case.loss_tol, "grad_norm_tol": case.grad_norm_tol}
    if case.tight_steps is not None and case.control is not None:
        per_step = per_step_tolerances(
            **tols,
            steps=case.steps,
            tight_steps=case.tight_steps,
            control=control.rows,
            control_factor=case.control_factor,
        )
        tols = dict(zip(tols, per_step, strict=True))
    first = {
        m: {k: v for k, v in getattr(s.scalars, m).items() if k <= case.steps}
        for m in TAGS
    }
    c = compare(
        RunScalars(**first), r.test, **tols, exact=case.exact, expected_steps=case.steps
    )
    print(f"[parity] baseline vs {name}:\n{format_table(c)}", flush=True)
    r.rows, r.max_dloss, r.max_dgrad_norm = c.rows, c.max_dloss, c.max_dgrad_norm
    r.failures += c.failures
    r.png_path = s.out / name / "parity.png" if c.rows else None
    if s.moment_step is not None:
        step = Path(_CKPT_FOLDER, f"step-{s.moment_step}")
        r.checkpoint, baseline = s.out / name / step, s.out / "baseline" / step
        tol = math.inf if case.moment_tol is None else case.moment_tol
        r.moments = compare_first_moments(baseline, r.checkpoint, tol=tol)
        r.failures += r.moments.failures
    r.passed = not r.failures
    return r


def _verdict(name: str, r: ParityResult) -> str:
    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3e}"

    moments = f", first moments {fmt(r.moments.max_error)}" if r.moments else ""
    return (
        f"{'PASSED' if r.passed else 'FAILED'} {name} (max |dloss| "
        f"{fmt(r.max_dloss)}, max |dgrad_norm| {fmt(r.max_dgrad_norm)}{moments})"
    )


def _jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become strings instead of bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _write_test_report(
    s: _Suite, name: str, case: ParityCase, r: ParityResult, wall_s: float
) -> dict:
    """``<out>/<name>/parity.json`` (and ``parity.png``) and the verdict; returns
    what ``suite.json`` says of the test, a part of its report."""
    r.json_path.parent.mkdir(parents=True, exist_ok=True)
    if r.png_path:
        _plot(r, name)
    entry = {
        "passed": r.passed,
        "failures": r.failures,
        **{k: getattr(case, k) for k in _SETTINGS},
        "max_dloss": r.max_dloss,
        "max_dgrad_norm": r.max_dgrad_norm,
        "max_moment_error": r.moments.max_error if r.moments else None,
        "test": asdict(case.spec),
        "png": r.png_path,
    }
    moments = {"step": s.moment_step, **r.moments.summary()} if r.moments else None
    report = {
        "name": name,
        **entry,
        "tags": TAGS,
        "moments": moments,
        **s.shared_json(r.runs),
        "per_step": [asdict(row) for row in r.rows],
        # The shared seed and baseline runs count in every test's time.
        "total_wall_s": s.wall_s + wall_s,
    }
    r.json_path.write_text(json.dumps(_jsonable(report), indent=2) + "\n")
    bounds = f"loss_tol={case.loss_tol:g}, grad_norm_tol={case.grad_norm_tol:g}"
    if case.control is not None and case.tight_steps is not None:
        bounds += f" to step {case.tight_steps}, then {case.control_factor:g} x "
        bounds += f"{case.control}'s running max"
    bounds = "exact" if case.exact else bounds
    if case.moment_tol is not None:
        bounds += f", first moments {case.moment_tol:g}"
    print(f"[parity] {_verdict(name, r)}; {bounds}; summary: {r.json_path}", flush=True)
    for failure in r.failures:
        print(f"[parity]   {failure}", flush=True)
    test_wall_s = r.runs[-1].wall_s if len(r.runs) > len(s.runs) else None
    return {**entry, "wall_s": test_wall_s, "json": r.json_path}


def _plot(r: ParityResult, name: str) -> None:
    """Loss curves, then |dloss| and |dgrad_norm| per step on log axes, exact
    zeros drawn at a visible floor."""
    steps = [row.step for row in r.rows]
    fig = Figure(figsize=(9, 9))
    ax_loss, *ax_diffs = fig.subplots(3, 1, sharex=True)
    ax_loss.plot(steps, [row.baseline_loss for row in r.rows], "o-", label="baseline")
    ax_loss.plot(steps, [row.test_loss for row in r.rows], "x--", label=name)
    ax_loss.set(ylabel="loss", title=f"parity: baseline vs {name}, {len(r.rows)} steps")
    for ax, metric in zip(ax_diffs, ("dloss", "dgrad_norm"), strict=True):
        diffs = {row.step: getattr(row, metric) for row in r.rows}
        finite = [d for d in diffs.values() if 0 < d < math.inf]
        floor = min(finite) / 10 if finite else 1e-12
        nonzero = [(s, min(d, 1e300)) for s, d in diffs.items() if d > 0]
        zeros = [s for s, d in diffs.items() if d == 0]
        label = f"|{metric}|"
        if nonzero:
            ax.plot(*zip(*nonzero, strict=True), "o-", color="tab:red", label=label)
        if zeros:
            drawn = f"{label} = 0 exactly (drawn at {floor:.0e})"
            ax.plot(zeros, [floor] * len(zeros), "s", color="tab:green", label=drawn)
        ax.set(yscale="log", ylabel=label)
    for ax in (ax_loss, *ax_diffs):
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    ax_diffs[-1].set(xlabel="step")
    ax_diffs[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(r.png_path, dpi=100)


def run_parity_suite(
    baseline: RunSpec, tests: Mapping[str, RunSpec | ParityCase], **options
) -> dict[str, ParityResult]:
    """Compare several tests with one baseline, trained once from one seed.

    A test is a ``RunSpec`` or a :class:`ParityCase`, trained and compared in order;
    ``options`` are the fields of ``_Suite``. A failed seed or baseline fails every
    test, a failed test only itself; nothing raises: see ``passed``."""
    s = _Suite(baseline=baseline, **options)
    cases = _resolve_cases(tests, s)
    s.out.mkdir(parents=True, exist_ok=True)
    # The seed (unless given or disabled) and the baseline; stops at a failure.
    seed = s.seed_checkpoint
    if seed is True:
        argv = [*_SEED_PARALLELISM, *shlex.split(s.seed_options)]
        argv += ["--checkpoint.create_seed_checkpoint", "--checkpoint.enable"]
        argv += [f"--checkpoint.folder={_CKPT_FOLDER}", *_DETERMINISTIC]
        s.runs.append(_launch(s, "seed", s.baseline.job_env(ngpu=1), argv))
        seed = s.out / "seed" / _CKPT_FOLDER / "step-0"
        if not s.runs[0].ok:
            s.failures.append(s.runs[0].failure())
        elif not (seed / ".metadata").is_file():
            s.failures.append(f"seed run succeeded but wrote no checkpoint at {seed}")
    if seed:
        s.load_args = [
            f"--checkpoint.initial_load_path={seed}",
            "--checkpoint.initial_load_model_only",
            *(["--checkpoint.initial_load_in_hf"] if _is_hf(seed) else []),
        ]
    if not s.failures:
        record, s.scalars, s.failures = _train(s, "baseline", s.baseline, s.steps)
        s.runs.append(record)
    s.wall_s = time.monotonic() - s.started
    results: dict[str, ParityResult] = {}
    entries: dict[str, dict] = {}
    for name, case in cases.items():
        started = time.monotonic()
        r = results[name] = _run_test(s, name, case, results.get(case.control))
        entries[name] = _write_test_report(s, name, case, r, time.monotonic() - started)
    summary = {
        "passed": all(r.passed for r in results.values()),
        "steps": s.steps,
        "moment_step": s.moment_step,
        **s.shared_json(s.runs),
        "failures": s.failures,
        "tests": entries,
        "total_wall_s": time.monotonic() - s.started,
    }
    path = s.out / "suite.json"
    path.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
    passed = sum(r.passed for r in results.values())
    print(f"[parity] suite: {passed}/{len(results)} passed; summary: {path}")
    for name, r in results.items():
        print(f"[parity]   {_verdict(name, r)}", flush=True)
    return results


def run_parity(baseline: RunSpec, test: RunSpec | None = None, **options):
    """A suite of one test named ``test``, by default the baseline's job without
    its options; ``options`` as for ``run_parity_suite``."""
    if test is None:
        test = dataclasses.replace(baseline, options="")
    return run_parity_suite(baseline, {"test": test}, **options)["test"]
