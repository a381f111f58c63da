"""Launching one ``run_train.sh`` command: what runs, where it logs, how it ends."""

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["REPO_ROOT", "RUN_TRAIN", "RunRecord", "RunSpec", "launch_run"]

DEFAULT_MODULE = "torchtitan_ext.muse_glimmer"
DEFAULT_CONFIG = "muse_glimmer_debugmodel_mm"

REPO_ROOT = Path(__file__).resolve().parents[3]
RUN_TRAIN = REPO_ROOT / "run_train.sh"

# run_train.sh reads these; a value inherited from the caller's shell would
# silently change which job runs, or where.
_LAUNCH_ENV = frozenset(
    "CONFIG_FILE TRAIN_FILE MODULE CONFIG NGPU NNODES NODE_RANK RDZV_ENDPOINT".split()
)


@dataclass(kw_only=True, slots=True)
class RunSpec:
    """One side of a comparison: which job to train, with what, on how many ranks.

    ``config_file`` (a TOML job) replaces ``module``/``config``; ``options`` are
    trainer flags in one shell string, as in ``loss_compare.py``; ``env`` extra
    ``run_train.sh`` variables; ``ngpu`` defaults to what the job's degrees ask.
    """

    module: str = DEFAULT_MODULE
    config: str = DEFAULT_CONFIG
    config_file: str | None = None
    options: str = ""
    ngpu: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.config_file:
            # The runs may start elsewhere than the caller's working directory.
            self.config_file = str(Path(self.config_file).resolve())
            if not Path(self.config_file).is_file():
                raise ValueError(f"config file not found: {self.config_file}")
            if self.ngpu is None:
                from torchtitan_ext.config_file import job_ranks, load_job

                args = ["--job.config_file", self.config_file, *self.option_args()]
                self.ngpu = job_ranks(load_job(args))
        self.ngpu = 1 if self.ngpu is None else self.ngpu
        if self.ngpu < 1:
            raise ValueError(f"ngpu must be at least 1, got {self.ngpu}")

    def job_env(self, ngpu: int | None = None) -> dict[str, str]:
        env = {**self.env, "NGPU": str(self.ngpu if ngpu is None else ngpu)}
        if self.config_file:
            return {**env, "CONFIG_FILE": self.config_file}
        return {**env, "MODULE": self.module, "CONFIG": self.config}

    def option_args(self) -> list[str]:
        return shlex.split(self.options)


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """One launched training process: what ran, how it ended, where its log is."""

    name: str
    command: str
    log_path: str
    # What ran, to run it again (e.g. the same command resuming a checkpoint).
    job_env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    returncode: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def failure(self) -> str:
        """Why the run failed, in one line that names its log."""
        why = f"failed with exit code {self.returncode}"
        if self.timed_out:
            why = "timed out; its process group was killed"
        return f"{self.name} run {why} (log: {self.log_path})"


def _pump(src: IO[str], log: IO[str], echo: bool) -> None:
    for line in src:
        log.write(line)
        if echo:
            print(line, end="", flush=True)


def _torchrun(env: dict[str, str], argv: list[str], log: IO[str], timeout, echo):
    """``argv`` in a session of its own, killed whole past ``timeout`` (a hang)."""
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
    pump = threading.Thread(target=_pump, args=(proc.stdout, log, echo))
    pump.start()
    code, timed_out = None, False
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # timed out, or interrupted: kill the whole run
        # torchrun and its ranks share the session we gave them.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(timeout=15)
        pump.join(timeout=30)
    return code, timed_out


def _forked(env: dict[str, str], argv: list[str], log: IO[str], timeout, echo):
    """``run_train.sh`` on ``local_ranks``' forked ranks: (exit code, timed out).

    The same entry module, job arguments and environment; the log gets the
    ``LOG_RANK`` ranks' output as torchrun's ``--tee`` gives it, after the run.
    """
    from torchtitan_ext.tools.local_ranks import RankError, run_module, run_on_ranks

    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "NGPU": "1", **env}
    if env.get("NNODES", "1") != "1":
        raise ValueError(f"forked runs are one node, not NNODES={env['NNODES']}")
    # RunSpec.job_env names the job one way or the other; no default of its own.
    job = ["--module", env.get("MODULE"), "--config", env.get("CONFIG")]
    if "CONFIG_FILE" in env:
        job = ["--job.config_file", env["CONFIG_FILE"]]
    code, timed_out, logs = 0, False, Path(log.name + ".ranks")
    logs.mkdir(exist_ok=True)
    module, ranks = env.get("TRAIN_FILE", "torchtitan_ext.train"), int(env["NGPU"])
    run = (run_module, ranks, module, job + argv[1:], env, str(logs))
    try:
        run_on_ranks(*run, timeout_s=timeout or 3600.0, init_process_group=False)
    except RankError as e:
        code = 1
        print(e, file=log)
    except TimeoutError as e:
        timed_out = True
        print(e, file=log)
    for rank in env.get("LOG_RANK", "0").split(","):
        with contextlib.suppress(OSError), open(logs / f"{rank}.log") as lines:
            for line in lines:
                _pump([f"[rank{rank}]:{line}"], log, echo)
    return code, timed_out


def launch_run(
    name: str,
    job_env: dict[str, str],
    argv: list[str],
    log_path: Path,
    *,
    timeout: float | None,
    echo: bool,
    forked: bool = False,
) -> RunRecord:
    """Run one ``run_train.sh`` command to completion, teeing it to ``log_path``.

    torchrun and its ranks run in a session of their own, so that a run past
    ``timeout`` (a hang) is killed whole. ``forked``: the same run on ranks
    forked by ``local_ranks`` instead of torchrun (the tests' parity runs).
    """
    # A copy-pasteable shell line, as loss_compare.py prints them.
    assigns = [f"{k}={shlex.quote(v)}" for k, v in job_env.items()]
    command = " ".join([*assigns, shlex.join(argv)])
    log_path, job_env, argv = str(log_path), dict(job_env), list(argv)
    record = RunRecord(
        name=name, command=command, log_path=log_path, job_env=job_env, argv=argv
    )
    print(f"[parity] {name}: {command}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    start = time.monotonic()
    with open(log_path, "w") as log:
        print(f"# {command}", file=log, flush=True)
        run = _forked if forked else _torchrun
        record.returncode, record.timed_out = run(
            {**env, **job_env}, argv, log, timeout, echo
        )
    record.wall_s = time.monotonic() - start
    status = f"exit code {record.returncode}"
    if record.timed_out:
        status = f"timed out after {timeout:g} s"
    print(f"[parity] {name}: {status}, {record.wall_s:.1f} s", flush=True)
    return record


def log_tail(path: str, n: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"
