"""Launch ``./run_train.sh`` from a test and read back what a run wrote.

``run_train`` is the parity harness's launcher (a hang is killed whole at the
timeout) that fails the test on a failed run; its ranks fork from one process
that imported torchtitan once (``forked``; ``local_ranks``), unless a test
reads what torchrun itself reports. ``checkpoint_tensors`` flattens a
DCP checkpoint (model and optimizer state, any world size) into
``{dotted.key: tensor}`` on one process.
"""

import shlex
from pathlib import Path

import pytest

from torchtitan_ext.tools.parity import (
    RUN_TRAIN,
    RunSpec,
    checkpoint_tensors,
    launch_run,
)

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "checkpoint_path", "checkpoint_tensors", "run_job", "run_train"]


def run_train(
    out: Path,
    name: str,
    toml: str,
    args: list[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    forked: bool = True,
) -> Path:
    """``CONFIG_FILE=train_configs/toml ./run_train.sh args`` on the ranks the
    file and ``args`` ask for; its dump folder."""
    job = RunSpec(
        config_file=str(REPO / "train_configs" / toml), options=shlex.join(args)
    )
    return run_job(out, name, job, [], timeout_s=timeout_s, env=env, forked=forked)


def run_job(
    out: Path,
    name: str,
    job: RunSpec,
    args: list[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    forked: bool = True,
) -> Path:
    """``./run_train.sh`` on ``job`` (its options, then ``args``); its dump folder.

    Fails the test, with the log's tail, if the run fails or times out.
    """
    dump = out / name
    record = launch_run(
        name,
        {**job.job_env(), **(env or {})},
        [str(RUN_TRAIN), f"--dump_folder={dump}", *job.option_args(), *args],
        out / f"{name}.log",
        timeout=timeout_s,
        echo=False,
        forked=forked,
    )
    if not record.ok:
        tail = "\n".join(Path(record.log_path).read_text().splitlines()[-40:])
        why = "timed out" if record.timed_out else f"exit {record.returncode}"
        pytest.fail(f"{name} failed ({why}), log {record.log_path}:\n{tail}")
    return dump


def checkpoint_path(dump: Path, step: int) -> Path:
    path = dump / "checkpoint" / f"step-{step}"
    assert (path / ".metadata").is_file(), f"no checkpoint at {path}"
    return path
