"""``python -m torchtitan_ext.parity``: do two training setups give the same losses?

Runs a baseline and a test configuration the way torchtitan's
``scripts/loss_compare.py`` does, then compares their per-step loss and
gradient norm. Typical use: the same job on 1 rank and with context
parallelism on 2 ranks must train identically.

How a comparison is made:

1. A seed checkpoint is created once, on one rank, from the baseline's job
   (``--checkpoint.create_seed_checkpoint``), in ``<output-dir>/seed``. Both
   runs then start from exactly the same weights: each gets its own, empty,
   dump folder and ``--checkpoint.initial_load_path=<seed>/checkpoint/step-0``
   (torchtitan loads the initial path only while the run's own checkpoint
   folder holds no step, and ``--checkpoint.load_only`` keeps it that way).
2. Each run trains ``--steps`` steps with ``--debug.deterministic
   --debug.seed=42`` and logs every step to TensorBoard, in
   ``<output-dir>/<baseline|test>/tb_<baseline|test>/<timestamp>``.
3. The scalars ``loss_metrics/global_avg_loss`` and ``grad_norm`` (the tags
   torchtitan's ``MetricsProcessor.log`` writes) are read back and compared
   step by step, exactly (``--exact``) or within tolerances.

The output dir keeps every run's log, ``parity.json`` (commands, values,
maxima, verdict, wall times) and ``parity.png`` (loss curves and |dloss|).

Many comparisons against one baseline: ``run_parity_suite(baseline, {name:
spec_or_ParityCase, ...})`` makes the seed and trains the baseline once, then
trains and compares each test, writing ``<output-dir>/<name>/parity.json``,
``parity.png`` and ``<output-dir>/suite.json``. The CLI runs one test.

Example::

    python -m torchtitan_ext.parity --steps 5 \\
        --baseline-options="--training.seq_len 256 --training.local_batch_size 2" \\
        --seed-options="--training.seq_len 256 --training.local_batch_size 2" \\
        --test-ngpu 2 --test-options="--training.seq_len 256 \\
            --training.local_batch_size 2 --parallelism.context_parallel_degree 2"

Write option strings as ``--x-options="..."``: argparse takes a separate
value that starts with ``--`` for a flag of its own.

Nothing here imports torch or torchtitan: training happens in subprocesses
started through ``run_train.sh``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

__all__ = [
    "GRAD_NORM_TAG",
    "LOSS_TAG",
    "Comparison",
    "ParityCase",
    "ParityError",
    "ParityResult",
    "RunRecord",
    "RunScalars",
    "RunSpec",
    "StepRow",
    "compare",
    "format_table",
    "launch_run",
    "main",
    "read_tb_scalars",
    "run_parity",
    "run_parity_suite",
]

LOSS_TAG = "loss_metrics/global_avg_loss"
GRAD_NORM_TAG = "grad_norm"

DEFAULT_MODULE = "torchtitan_ext.muse_glimmer"
DEFAULT_CONFIG = "muse_glimmer_debugmodel_mm"
DEFAULT_LOSS_TOL = 1e-5
DEFAULT_GRAD_NORM_TOL = 1e-4
SEED = 42

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_TRAIN = REPO_ROOT / "run_train.sh"

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
# run_train.sh reads these; a value inherited from the caller's shell would
# silently change which job runs, or where.
_LAUNCH_ENV = (
    "CONFIG_FILE",
    "MODULE",
    "CONFIG",
    "NGPU",
    "NNODES",
    "NODE_RANK",
    "RDZV_ENDPOINT",
)
_LOG_TAIL_LINES = 40


class ParityError(RuntimeError):
    """A run's outputs cannot be compared (no TensorBoard run, missing tags)."""


@dataclass(kw_only=True, slots=True)
class RunSpec:
    """One side of a comparison: which job to train, with what, on how many ranks.

    ``config_file`` (a TOML job, passed as ``CONFIG_FILE``) replaces
    ``module``/``config`` when set. ``options`` are extra trainer flags, one
    shell-quoted string as in ``loss_compare.py``.
    """

    module: str = DEFAULT_MODULE
    config: str = DEFAULT_CONFIG
    config_file: str | None = None
    options: str = ""
    ngpu: int = 1

    def __post_init__(self) -> None:
        if self.ngpu < 1:
            raise ValueError(f"ngpu must be at least 1, got {self.ngpu}")
        if self.config_file:
            # The runs may start elsewhere than the caller's working directory.
            self.config_file = str(Path(self.config_file).resolve())
            if not Path(self.config_file).is_file():
                raise ValueError(f"config file not found: {self.config_file}")

    def job_env(self, ngpu: int | None = None) -> dict[str, str]:
        """The ``run_train.sh`` variables that select this job."""
        env = {"NGPU": str(self.ngpu if ngpu is None else ngpu)}
        if self.config_file:
            env["CONFIG_FILE"] = self.config_file
        else:
            env["MODULE"] = self.module
            env["CONFIG"] = self.config
        return env

    def option_args(self) -> list[str]:
        return shlex.split(self.options)


@dataclass(kw_only=True, slots=True)
class RunScalars:
    """Per-step scalars of one run, as stored in its TensorBoard events."""

    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)


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


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """One launched training process: what ran, how it ended, where its log is."""

    name: str
    command: str
    log_path: str
    returncode: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass(kw_only=True, slots=True)
class ParityResult:
    """Everything a caller needs to judge, and to find, one parity run.

    ``output_dir`` holds all runs of the call (a suite's root); ``runs`` are
    the seed (if any), the baseline and the test, as far as they got.
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


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def _diff(a: float, b: float) -> float:
    """|a - b|, 0.0 only for values that are equal as stored (NaN equals NaN)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    d = abs(a - b)
    return math.inf if math.isnan(d) else d


def compare(
    baseline: RunScalars,
    test: RunScalars,
    *,
    loss_tol: float = DEFAULT_LOSS_TOL,
    grad_norm_tol: float = DEFAULT_GRAD_NORM_TOL,
    exact: bool = False,
    expected_steps: int | None = None,
) -> Comparison:
    """Compare two runs step by step.

    With ``exact`` any difference fails; otherwise max |dloss| must not exceed
    ``loss_tol`` nor max |dgrad_norm| ``grad_norm_tol``. Different step sets,
    no steps at all, or (with ``expected_steps``) steps other than
    ``1..expected_steps`` fail too: a parity claim over missing steps is empty.
    """
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
        if not max_dloss <= loss_tol:
            failures.append(f"max |dloss| {max_dloss:.8e} > loss_tol {loss_tol:.3e}")
        if not max_dgrad <= grad_norm_tol:
            failures.append(
                f"max |dgrad_norm| {max_dgrad:.8e} > grad_norm_tol {grad_norm_tol:.3e}"
            )
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


# ---------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------


def read_tb_scalars(tb_folder: str | os.PathLike[str]) -> RunScalars:
    """Read loss and grad_norm per step from ``<dump_folder>/<save_tb_folder>``.

    torchtitan writes each run into a ``<YYYYmmdd-HHMM>`` subfolder; exactly one
    must exist, or the values could silently come from a stale run.
    """
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

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
    values: dict[str, dict[int, float]] = {}
    for tag in (LOSS_TAG, GRAD_NORM_TAG):
        if tag not in tags:
            raise ParityError(
                f"scalar tag {tag!r} not found in {runs[0]}; available: {tags}"
            )
        # A step logged twice keeps its last value, as TensorBoard shows it.
        values[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return RunScalars(loss=values[LOSS_TAG], grad_norm=values[GRAD_NORM_TAG])


# ---------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------


def _command_string(env: dict[str, str], argv: Sequence[str]) -> str:
    """A copy-pasteable shell line, as loss_compare.py prints them."""
    return " ".join(
        [*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)]
    )


def _pump(src: IO[str], log: IO[str], echo: bool) -> None:
    for line in src:
        log.write(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Stop torchrun and all its ranks: they share the session we gave them."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def launch_run(
    name: str,
    job_env: dict[str, str],
    argv: list[str],
    log_path: Path,
    *,
    timeout: float | None,
    echo: bool,
) -> RunRecord:
    """Run one ``run_train.sh`` command to completion, teeing it to ``log_path``.

    torchrun and its ranks run in a session of their own, so a run past
    ``timeout`` (a hang) is killed whole and reported as timed out.
    """
    command = _command_string(job_env, argv)
    record = RunRecord(name=name, command=command, log_path=str(log_path))
    print(f"[parity] {name}: {command}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.update(job_env)
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"# {command}\n")
        log.flush()
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, echo))
        pump.start()
        try:
            record.returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            record.timed_out = True
            _kill_group(proc)
            record.returncode = proc.poll()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            pump.join(timeout=30)
    record.wall_s = time.monotonic() - start
    status = (
        f"timed out after {timeout:g} s"
        if record.timed_out
        else f"exit code {record.returncode}"
    )
    print(f"[parity] {name}: {status}, {record.wall_s:.1f} s", flush=True)
    return record


def _log_tail(path: str, n: int = _LOG_TAIL_LINES) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(lines[-n:])


def _run_failure(record: RunRecord) -> str:
    if record.timed_out:
        why = "timed out; its process group was killed"
    else:
        why = f"failed with exit code {record.returncode}"
    return f"{record.name} run {why} (log: {record.log_path})"


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become strings instead of bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _plot(
    rows: list[StepRow], path: Path, title: str, test_label: str = "test"
) -> None:
    """Loss curves on one axis, |dloss| per step on a log axis below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in rows]
    fig, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax_loss.plot(steps, [r.baseline_loss for r in rows], "o-", label="baseline")
    ax_loss.plot(steps, [r.test_loss for r in rows], "x--", label=test_label)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(title)
    ax_loss.legend()
    ax_loss.grid(True, alpha=0.3)

    diffs = [r.dloss for r in rows]
    finite = [d for d in diffs if d > 0 and math.isfinite(d)]
    # Exact zeros have no place on a log axis; draw them at a visible floor.
    floor = min(finite) / 10 if finite else 1e-12
    nonzero = [(s, d) for s, d in zip(steps, diffs, strict=True) if d > 0]
    zeros = [s for s, d in zip(steps, diffs, strict=True) if d == 0]
    if nonzero:
        ax_diff.plot(
            [s for s, _ in nonzero],
            [d if math.isfinite(d) else 1e300 for _, d in nonzero],
            "o-",
            color="tab:red",
            label="|dloss|",
        )
    if zeros:
        ax_diff.plot(
            zeros,
            [floor] * len(zeros),
            "s",
            color="tab:green",
            label=f"|dloss| = 0 exactly (drawn at {floor:.0e})",
        )
    ax_diff.set_yscale("log")
    ax_diff.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("|dloss|")
    ax_diff.legend()
    ax_diff.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _default_output_dir() -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("outputs") / "parity" / stamp


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

# Run names a suite's tests may not take: their logs and dump folders are shared.
_SHARED_RUN_NAMES = frozenset({"seed", "baseline"})
# A test's name becomes a folder and a log file name in the output dir.
_TEST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(slots=True)
class ParityCase:
    """One test of :func:`run_parity_suite`, with tolerances of its own.

    A field left ``None`` takes the suite's value: ``ParityCase(spec,
    exact=True)`` is compared bit for bit in a suite that otherwise uses
    tolerances, ``ParityCase(spec, loss_tol=1e-3)`` within a looser bound
    (in an ``exact`` suite, also pass ``exact=False``: the tolerances apply
    only to a comparison that is not exact).
    """

    spec: RunSpec
    _: dataclasses.KW_ONLY
    exact: bool | None = None
    loss_tol: float | None = None
    grad_norm_tol: float | None = None


@dataclass(kw_only=True, slots=True)
class _Tolerance:
    exact: bool
    loss_tol: float
    grad_norm_tol: float

    def describe(self) -> str:
        if self.exact:
            return "exact"
        return f"loss_tol={self.loss_tol:g}, grad_norm_tol={self.grad_norm_tol:g}"


@dataclass(kw_only=True, slots=True)
class _Session:
    """What every run of one call shares: where it writes, how it launches."""

    out: Path
    steps: int
    run_train: str
    precision: list[str]
    timeout: float | None
    echo: bool
    seed_options: str
    seed_checkpoint: bool
    keep_mixed_precision: bool
    # Print the test's name with its table and verdict (a suite has several).
    named: bool = False
    # Flags that make a run start from the seed checkpoint; set by _make_seed.
    load_args: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class _Baseline:
    """The seed and baseline runs, made once and compared against each test."""

    spec: RunSpec
    runs: list[RunRecord]
    failures: list[str]
    scalars: RunScalars | None
    wall_s: float


def _start(
    *,
    output_dir: str | os.PathLike[str] | None,
    steps: int,
    launcher: str | os.PathLike[str] | None,
    timeout: float | None,
    echo: bool,
    seed_options: str,
    seed_checkpoint: bool,
    keep_mixed_precision: bool,
    named: bool,
) -> _Session:
    """Check the arguments and create the (new or empty) output dir."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    out = Path(output_dir) if output_dir is not None else _default_output_dir()
    out = out.resolve()
    if out.exists() and any(out.iterdir()):
        # Stale checkpoints would be resumed, stale TB runs compared.
        raise ValueError(f"output dir {out} exists and is not empty")
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
        named=named,
    )


def _report_failed_run(record: RunRecord) -> None:
    if not record.ok:
        print(
            f"[parity] last lines of {record.log_path}:\n" + _log_tail(record.log_path),
            file=sys.stderr,
            flush=True,
        )


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
    record = launch_run(
        "seed",
        baseline.job_env(ngpu=1),
        argv,
        s.out / "seed.log",
        timeout=s.timeout,
        echo=s.echo,
    )
    _report_failed_run(record)
    seed_path = seed_dump / _SEED_CKPT_FOLDER / "step-0"
    failures: list[str] = []
    if not record.ok:
        failures.append(_run_failure(record))
    elif not (seed_path / ".metadata").is_file():
        failures.append(f"seed run succeeded but wrote no checkpoint at {seed_path}")
    s.load_args = [
        f"--checkpoint.initial_load_path={seed_path}",
        "--checkpoint.initial_load_model_only",
    ]
    return record, failures


def _train(
    s: _Session, name: str, spec: RunSpec
) -> tuple[RunRecord, RunScalars | None, list[str]]:
    """Train ``spec`` for ``s.steps`` steps into ``<out>/<name>``; read its scalars."""
    dump = s.out / name
    tb_folder = f"tb_{name}"
    argv = [
        s.run_train,
        f"--dump_folder={dump}",
        *s.precision,
        *spec.option_args(),
        "--debug.deterministic",
        f"--debug.seed={SEED}",
        "--metrics.enable_tensorboard",
        "--metrics.log_freq=1",
        f"--training.steps={s.steps}",
        f"--metrics.save_tb_folder={tb_folder}",
        "--checkpoint.enable",
        "--checkpoint.load_only",
        *s.load_args,
    ]
    record = launch_run(
        name,
        spec.job_env(),
        argv,
        s.out / f"{name}.log",
        timeout=s.timeout,
        echo=s.echo,
    )
    _report_failed_run(record)
    if not record.ok:
        return record, None, [_run_failure(record)]
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
    if s.seed_checkpoint:
        record, failures = _make_seed(s, baseline)
        runs.append(record)
    if not failures:
        record, scalars, failures = _train(s, "baseline", baseline)
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
        **({} if record.ok else {"log_tail": _log_tail(record.log_path)}),
    }


def _finish(
    s: _Session,
    base: _Baseline,
    *,
    name: str,
    spec: RunSpec,
    tol: _Tolerance,
    report_dir: Path,
    started: float,
    record: RunRecord | None,
    scalars: RunScalars | None,
    failures: list[str],
) -> ParityResult:
    """Compare one test with the baseline; write its parity.json and parity.png."""
    failures = [*base.failures, *failures]
    runs = [*base.runs, *([record] if record else [])]
    prefix = f"{name}: " if s.named else ""

    comparison: Comparison | None = None
    if not failures and base.scalars is not None and scalars is not None:
        comparison = compare(
            base.scalars,
            scalars,
            loss_tol=tol.loss_tol,
            grad_norm_tol=tol.grad_norm_tol,
            exact=tol.exact,
            expected_steps=s.steps,
        )
        failures.extend(comparison.failures)
        if s.named:
            print(f"[parity] baseline vs {name}:", flush=True)
        print(format_table(comparison), flush=True)

    report_dir.mkdir(parents=True, exist_ok=True)
    rows = comparison.rows if comparison else []
    png_path: Path | None = None
    if rows:
        png_path = report_dir / "parity.png"
        _plot(rows, png_path, f"parity: baseline vs {name}, {len(rows)} steps", name)

    passed = comparison is not None and comparison.passed and not failures
    json_path = report_dir / "parity.json"
    summary = {
        "name": name,
        "passed": passed,
        "failures": failures,
        "exact": tol.exact,
        "loss_tol": tol.loss_tol,
        "grad_norm_tol": tol.grad_norm_tol,
        "steps": s.steps,
        "tags": {"loss": LOSS_TAG, "grad_norm": GRAD_NORM_TAG},
        "max_dloss": comparison.max_dloss if comparison else None,
        "max_dgrad_norm": comparison.max_dgrad_norm if comparison else None,
        "baseline": dataclasses.asdict(base.spec),
        "test": dataclasses.asdict(spec),
        "seed_options": s.seed_options if s.seed_checkpoint else None,
        "keep_mixed_precision": s.keep_mixed_precision,
        "runs": [_run_record_json(r) for r in runs],
        "per_step": [dataclasses.asdict(r) for r in rows],
        # The shared seed and baseline runs count in every test's time.
        "total_wall_s": base.wall_s + (time.monotonic() - started),
        "png": str(png_path) if png_path else None,
    }
    json_path.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")

    verdict = "PASSED" if passed else "FAILED"
    print(
        f"[parity] {prefix}{verdict} ({tol.describe()}); summary: {json_path}",
        flush=True,
    )
    for failure in failures:
        print(f"[parity]   {failure}", flush=True)
    return ParityResult(
        passed=passed,
        rows=rows,
        max_dloss=summary["max_dloss"],
        max_dgrad_norm=summary["max_dgrad_norm"],
        failures=failures,
        runs=runs,
        output_dir=s.out,
        json_path=json_path,
        png_path=png_path,
        baseline=base.scalars,
        test=scalars,
    )


def _run_test(
    s: _Session,
    base: _Baseline,
    *,
    name: str,
    spec: RunSpec,
    tol: _Tolerance,
    report_dir: Path,
) -> ParityResult:
    """Train one test (unless the baseline failed) and compare it."""
    started = time.monotonic()
    record: RunRecord | None = None
    scalars: RunScalars | None = None
    failures: list[str] = []
    if not base.failures:
        record, scalars, failures = _train(s, name, spec)
    return _finish(
        s,
        base,
        name=name,
        spec=spec,
        tol=tol,
        report_dir=report_dir,
        started=started,
        record=record,
        scalars=scalars,
        failures=failures,
    )


def run_parity(
    baseline: RunSpec,
    test: RunSpec | None = None,
    *,
    steps: int = 10,
    seed_options: str = "",
    seed_checkpoint: bool = True,
    output_dir: str | os.PathLike[str] | None = None,
    loss_tol: float = DEFAULT_LOSS_TOL,
    grad_norm_tol: float = DEFAULT_GRAD_NORM_TOL,
    exact: bool = False,
    keep_mixed_precision: bool = False,
    timeout: float | None = None,
    launcher: str | os.PathLike[str] | None = None,
    echo: bool = False,
) -> ParityResult:
    """Train ``baseline`` and ``test`` from one seed checkpoint and compare them.

    ``test`` defaults to the baseline's job with no options. ``timeout`` is per
    run, in seconds. ``launcher`` replaces ``run_train.sh`` (same environment
    and arguments), ``echo`` copies the runs' output to stdout. A failed run
    or comparison does not raise: it shows in ``passed`` and ``failures``.

    Writes ``seed/``, ``baseline/``, ``test/``, their ``.log`` files,
    ``parity.json`` and ``parity.png`` into ``output_dir``.
    """
    if test is None:
        test = RunSpec(
            module=baseline.module,
            config=baseline.config,
            config_file=baseline.config_file,
            ngpu=baseline.ngpu,
        )
    s = _start(
        output_dir=output_dir,
        steps=steps,
        launcher=launcher,
        timeout=timeout,
        echo=echo,
        seed_options=seed_options,
        seed_checkpoint=seed_checkpoint,
        keep_mixed_precision=keep_mixed_precision,
        named=False,
    )
    return _run_test(
        s,
        _run_baseline(s, baseline),
        name="test",
        spec=test,
        tol=_Tolerance(exact=exact, loss_tol=loss_tol, grad_norm_tol=grad_norm_tol),
        report_dir=s.out,
    )


def _suite_cases(tests: Mapping[str, RunSpec | ParityCase]) -> dict[str, ParityCase]:
    """The suite's tests as ParityCases, their names checked before any run."""
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
        cases[name] = value
    return cases


def run_parity_suite(
    baseline: RunSpec,
    tests: Mapping[str, RunSpec | ParityCase],
    *,
    steps: int = 10,
    seed_options: str = "",
    seed_checkpoint: bool = True,
    output_dir: str | os.PathLike[str] | None = None,
    loss_tol: float = DEFAULT_LOSS_TOL,
    grad_norm_tol: float = DEFAULT_GRAD_NORM_TOL,
    exact: bool = False,
    keep_mixed_precision: bool = False,
    timeout: float | None = None,
    launcher: str | os.PathLike[str] | None = None,
    echo: bool = False,
) -> dict[str, ParityResult]:
    """Compare several tests with one baseline, trained once from one seed.

    The seed checkpoint and the baseline are made once; then each test trains
    in ``tests``' order and is compared with the baseline. A value is a
    ``RunSpec`` (compared with the suite's ``exact``/``loss_tol``/
    ``grad_norm_tol``) or a :class:`ParityCase` whose non-``None`` fields
    override them for that test. Names must match ``[A-Za-z0-9][A-Za-z0-9_.-]*``
    and not be ``seed`` or ``baseline``. The other arguments are
    :func:`run_parity`'s.

    Layout of ``output_dir``: ``seed/``, ``seed.log``, ``baseline/``,
    ``baseline.log``; per test ``<name>.log`` and ``<name>/`` (its dump folder,
    with ``parity.json`` and ``parity.png``); ``suite.json`` lists every
    test's verdict and maxima. If the seed or baseline fails, no test trains
    and every result fails with that reason; a failing test does not stop
    the others. Nothing raises for a failed run: see each result's ``passed``.
    """
    cases = _suite_cases(tests)
    suite_start = time.monotonic()
    s = _start(
        output_dir=output_dir,
        steps=steps,
        launcher=launcher,
        timeout=timeout,
        echo=echo,
        seed_options=seed_options,
        seed_checkpoint=seed_checkpoint,
        keep_mixed_precision=keep_mixed_precision,
        named=True,
    )
    base = _run_baseline(s, baseline)
    results: dict[str, ParityResult] = {}
    tolerances: dict[str, _Tolerance] = {}
    for name, case in cases.items():
        tol = _Tolerance(
            exact=exact if case.exact is None else case.exact,
            loss_tol=loss_tol if case.loss_tol is None else case.loss_tol,
            grad_norm_tol=(
                grad_norm_tol if case.grad_norm_tol is None else case.grad_norm_tol
            ),
        )
        tolerances[name] = tol
        results[name] = _run_test(
            s, base, name=name, spec=case.spec, tol=tol, report_dir=s.out / name
        )

    suite_path = s.out / "suite.json"
    passed = all(r.passed for r in results.values())
    summary = {
        "passed": passed,
        "steps": steps,
        "baseline": dataclasses.asdict(baseline),
        "seed_options": seed_options if seed_checkpoint else None,
        "keep_mixed_precision": keep_mixed_precision,
        "failures": base.failures,
        "runs": [_run_record_json(r) for r in base.runs],
        "tests": {
            name: {
                "passed": r.passed,
                "max_dloss": r.max_dloss,
                "max_dgrad_norm": r.max_dgrad_norm,
                "exact": tolerances[name].exact,
                "loss_tol": tolerances[name].loss_tol,
                "grad_norm_tol": tolerances[name].grad_norm_tol,
                "failures": r.failures,
                "test": dataclasses.asdict(cases[name].spec),
                "wall_s": r.runs[-1].wall_s if len(r.runs) > len(base.runs) else None,
                "json": str(r.json_path),
                "png": str(r.png_path) if r.png_path else None,
            }
            for name, r in results.items()
        },
        "total_wall_s": time.monotonic() - suite_start,
    }
    suite_path.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")

    n_passed = sum(r.passed for r in results.values())
    print(
        f"[parity] suite: {n_passed}/{len(results)} passed; summary: {suite_path}",
        flush=True,
    )

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3e}"

    for name, r in results.items():
        print(
            f"[parity]   {'PASSED' if r.passed else 'FAILED'} {name} "
            f"(max |dloss| {fmt(r.max_dloss)}, "
            f"max |dgrad_norm| {fmt(r.max_dgrad_norm)})",
            flush=True,
        )
    return results


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.parity",
        description=(
            "Train a baseline and a test configuration from one seed checkpoint "
            "and compare their per-step loss and grad_norm."
        ),
    )
    for side in ("baseline", "test"):
        group = parser.add_argument_group(side)
        group.add_argument(
            f"--{side}-module",
            default=DEFAULT_MODULE if side == "baseline" else None,
            help=f"registry module (default: {DEFAULT_MODULE}"
            + ("" if side == "baseline" else ", or the baseline's")
            + ")",
        )
        group.add_argument(
            f"--{side}-config",
            default=DEFAULT_CONFIG if side == "baseline" else None,
            help=f"registry config function (default: {DEFAULT_CONFIG}"
            + ("" if side == "baseline" else ", or the baseline's")
            + ")",
        )
        group.add_argument(
            f"--{side}-config-file",
            default=None,
            help="TOML job file (CONFIG_FILE), instead of module/config",
        )
        group.add_argument(
            f"--{side}-options",
            default="",
            help=f'extra trainer flags, one string: --{side}-options="--a 1 --b 2"',
        )
        group.add_argument(
            f"--{side}-ngpu", type=int, default=1, help="ranks (default: 1)"
        )
    parser.add_argument("--steps", type=int, default=10, help="steps (default: 10)")
    parser.add_argument(
        "--seed-options",
        default="",
        help="extra flags for the seed-checkpoint run (baseline's job, 1 rank); "
        "must agree with the runs on anything that shapes the model",
    )
    parser.add_argument(
        "--no-seed-checkpoint",
        action="store_true",
        help="let each run initialise its own weights instead",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="new or empty folder for logs and reports "
        "(default: outputs/parity/<timestamp>)",
    )
    parser.add_argument(
        "--loss-tol", type=float, default=DEFAULT_LOSS_TOL, help="max |dloss|"
    )
    parser.add_argument(
        "--grad-norm-tol",
        type=float,
        default=DEFAULT_GRAD_NORM_TOL,
        help="max |dgrad_norm|",
    )
    parser.add_argument(
        "--exact", action="store_true", help="fail on any difference at all"
    )
    parser.add_argument(
        "--keep-mixed-precision",
        action="store_true",
        help="do not force --training.mixed_precision_param float32",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per run (default: none)"
    )
    parser.add_argument(
        "--quiet", action="store_true", help="do not echo the runs' output"
    )
    return parser


def _specs(args: argparse.Namespace) -> tuple[RunSpec, RunSpec]:
    """RunSpecs from parsed args; the test side inherits the baseline's job."""
    baseline = RunSpec(
        module=args.baseline_module,
        config=args.baseline_config,
        config_file=args.baseline_config_file,
        options=args.baseline_options,
        ngpu=args.baseline_ngpu,
    )
    job_given = args.test_module or args.test_config or args.test_config_file
    test = RunSpec(
        module=args.test_module or baseline.module,
        config=args.test_config or baseline.config,
        config_file=args.test_config_file
        or (None if job_given else baseline.config_file),
        options=args.test_options,
        ngpu=args.test_ngpu,
    )
    return baseline, test


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 on parity, 1 otherwise, 2 on usage errors."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        baseline, test = _specs(args)
        result = run_parity(
            baseline,
            test,
            steps=args.steps,
            seed_options=args.seed_options,
            seed_checkpoint=not args.no_seed_checkpoint,
            output_dir=args.output_dir,
            loss_tol=args.loss_tol,
            grad_norm_tol=args.grad_norm_tol,
            exact=args.exact,
            keep_mixed_precision=args.keep_mixed_precision,
            timeout=args.timeout,
            echo=not args.quiet,
        )
    except ValueError as e:
        parser.error(str(e))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
