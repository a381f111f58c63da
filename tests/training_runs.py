"""Launch ``./run_train.sh`` from a test and read back what a run wrote.

``run_train`` starts torchrun and its ranks as one process group, so a run
that passes its timeout (a hang) is killed whole; its log keeps the command
line and exit code. ``checkpoint_tensors`` flattens a DCP checkpoint (model and
optimizer state, any world size) into ``{dotted.key: tensor}`` on one process.
"""

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "checkpoint_path", "checkpoint_tensors", "run_train"]


def run_train(
    out: Path,
    name: str,
    ngpu: int,
    toml: str,
    args: list[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> Path:
    """``NGPU=ngpu CONFIG_FILE=train_configs/toml ./run_train.sh ...``; its dump."""
    dump = out / name
    log = out / f"{name}.log"
    run_env = {k: v for k, v in os.environ.items() if k not in ("MODULE", "CONFIG")}
    run_env.update(NGPU=str(ngpu), CONFIG_FILE=str(REPO / "train_configs" / toml))
    run_env.update(env or {})
    argv = [str(REPO / "run_train.sh"), f"--dump_folder={dump}", *args]
    start = time.monotonic()
    with log.open("w") as f:
        config_file = run_env["CONFIG_FILE"]
        f.write(f"# NGPU={ngpu} CONFIG_FILE={config_file} {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=run_env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall_s = time.monotonic() - start
    with log.open("a") as f:
        f.write(f"# exit code {returncode} after {wall_s:.1f} s\n")
    if returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"{name} failed (exit {returncode}), log {log}:\n{tail}")
    return dump


def checkpoint_path(dump: Path, step: int) -> Path:
    path = dump / "checkpoint" / f"step-{step}"
    assert (path / ".metadata").is_file(), f"no checkpoint at {path}"
    return path


def _flatten(value, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, torch.Tensor):
        out[prefix] = value


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    tensors: dict[str, torch.Tensor] = {}
    _flatten(state, "", tensors)
    return tensors
