"""The launchers: run_train.sh takes the command lines torchtitan's
scripts/loss_compare.py makes; ``local_ranks``' forked ranks are torchrun's."""

import errno
import os
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from torchtitan_ext.tools.local_ranks import RankError, run_module, run_on_ranks
from torchtitan_ext.tools.parity import RunScalars, read_tb_scalars

from ..parity_suites import FP32
from ..training_runs import run_train

REPO = Path(__file__).resolve().parents[2]
FIXED_OPTIONS = "--debug.deterministic --debug.seed=42"
SMALL = "--training.seq_len 256 --training.local_batch_size 2"


def _shell(command: str, ngpu: int, cwd: Path, **env_vars: str) -> str:
    env = {**os.environ, "NGPU": str(ngpu), **env_vars}
    for name in ("CONFIG_FILE", "MODULE", "CONFIG", "NNODES", "NODE_RANK"):
        env.pop(name, None)
    run = subprocess.run(
        command,
        shell=True,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    return output


def test_loss_compare_invocation(tmp_path):
    """Seed on one rank, then a 2-rank run that loads it, from the repo root."""
    job = "MODULE='torchtitan_ext.muse_glimmer' CONFIG='muse_glimmer_debugmodel_mm'"
    dump = tmp_path / "loss_compare"
    _shell(
        f"{job} ./run_train.sh --dump_folder={dump} "
        f"--checkpoint.create_seed_checkpoint --checkpoint.enable {FIXED_OPTIONS} "
        f"{SMALL}",
        ngpu=1,
        cwd=REPO,
    )
    output = _shell(
        f"{job} ./run_train.sh --dump_folder={dump} "
        f"--parallelism.data_parallel_shard_degree=2 {SMALL} {FIXED_OPTIONS} "
        "--metrics.enable_tensorboard --metrics.log_freq=1 --training.steps=3 "
        "--metrics.save_tb_folder=tb_test "
        "--checkpoint.enable --checkpoint.export_dtype=bfloat16 "
        "--checkpoint.load_only",
        ngpu=2,
        cwd=REPO,
    )
    assert "Loading the checkpoint from" in output
    scalars = read_tb_scalars(dump / "tb_test")
    assert sorted(scalars.loss) == [1, 2, 3]
    assert all(0 < loss < 20 for loss in scalars.loss.values())


def test_default_train_command_halves_the_loss(tmp_path):
    """``./run_train.sh`` with no variables or flags: 16 steps, the loss halves.

    It writes where the README says: TensorBoard under ``outputs/tb`` and the
    final model checkpoint under ``outputs/checkpoint/step-16``, in the
    directory it runs from. Run again, it resumes there and says that it has
    nothing left to train, and how to start over. Its data, in a folder that
    does not exist yet, is made by the launcher on first use.
    """
    assets = {"TORCHTITAN_EXT_ASSETS": str(tmp_path / "assets")}
    _shell(str(REPO / "run_train.sh"), ngpu=1, cwd=tmp_path, **assets)
    assert (tmp_path / "assets" / "manifest.json").is_file()
    out = tmp_path / "outputs"
    scalars = read_tb_scalars(out / "tb")
    losses = [scalars.loss[step] for step in sorted(scalars.loss)]
    assert len(losses) == 16
    assert losses[-1] < losses[0] / 2, losses
    assert (out / "checkpoint" / "step-16" / ".metadata").is_file()
    again = _shell(str(REPO / "run_train.sh"), ngpu=1, cwd=tmp_path, **assets)
    assert "Resumed at step 16" in again and "nothing left to train" in again
    assert "step:  1 " not in again


# A CP2 job, 2 fp32 steps of unpacked 256-token rows: the forked launcher's runs.
CP2_ARGS = [
    *FIXED_OPTIONS.split(),
    *SMALL.split(),
    "--dataloader.packing_buffer_size=0",
    FP32,
    "--training.steps=2",
    "--metrics.enable_tensorboard",
    "--metrics.log_freq=1",
]


def _cp2_scalars(out: Path, name: str, forked: bool, env=None) -> RunScalars:
    dump = run_train(
        out, name, "cp2.toml", CP2_ARGS, timeout_s=600, env=env, forked=forked
    )
    return read_tb_scalars(dump / "tb")


def test_forked_ranks_train_bitwise_as_torchrun(tmp_path):
    """``local_ranks``' forked ranks train the suite's runs: they must compute
    what torchrun's ranks do, loss and grad norm bitwise, every step. Each run
    initialises its own weights (``--debug.seed``): the init is compared too."""
    torchrun = _cp2_scalars(tmp_path, "torchrun", forked=False)
    forked = _cp2_scalars(tmp_path, "forked", forked=True)
    assert sorted(torchrun.loss) == sorted(torchrun.grad_norm) == [1, 2]
    assert forked.loss == torchrun.loss
    assert forked.grad_norm == torchrun.grad_norm


def _rendezvous_port_state() -> tuple[bool, str]:
    """Whether this rank's ``MASTER_PORT`` is bound already, before any group
    exists; then the value another rank set in the store served there."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
            bound = False
        except OSError as e:
            bound = e.errno == errno.EADDRINUSE
    if not bound:
        return False, ""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store.set(f"from{rank}", str(rank))
    return True, store.get(f"from{(rank + 1) % world_size}").decode()


def test_the_rendezvous_port_is_held_for_the_ranks_before_they_start():
    """The launcher serves the store on a port the OS bound, as torchrun's agent
    does: no free port left open for a parallel launch to take meanwhile."""
    results = run_on_ranks(
        _rendezvous_port_state, 2, timeout_s=60, init_process_group=False
    )
    assert results == [(True, "1"), (True, "0")]


@record
def _raise_recorded() -> None:
    """Each rank raises its own error through torch's ``@record``, as the
    Trainer's ``__init__`` and ``train`` do; after a barrier, so both do."""
    dist.barrier()
    raise ValueError(f"rank {dist.get_rank()} refuses")


def test_every_ranks_error_file_is_reported():
    """torchrun's ``TORCHELASTIC_ERROR_FILE`` per rank: ``@record`` writes it,
    and ``RankError`` reports every rank's, not only the first failure seen."""
    with pytest.raises(RankError) as raised:
        run_on_ranks(_raise_recorded, 2, timeout_s=60)
    errors = {r: f"ValueError: rank {r} refuses" for r in (0, 1)}
    assert raised.value.errors == errors
    assert all(f"rank {r}: {m}" in str(raised.value) for r, m in errors.items())


@pytest.mark.parametrize("omp_num_threads", [None, "2"])
def test_forked_ranks_take_run_train_sh_thread_count(
    tmp_path, monkeypatch, omp_num_threads
):
    """``OMP_NUM_THREADS`` as ``run_train.sh`` exports it to torchrun's ranks:
    the caller's, else 1 on several ranks. Reductions split by thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    probe = tmp_path / "threads_probe.py"
    probe.write_text(
        "import os, pathlib, torch\n"
        "out = pathlib.Path(os.environ['PROBE_OUT'], os.environ['RANK'])\n"
        "out.write_text(str(torch.get_num_threads()))\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PROBE_OUT": str(tmp_path)}
    if omp_num_threads:
        env["OMP_NUM_THREADS"] = omp_num_threads
    run = (run_module, 2, "threads_probe", [], env, str(tmp_path))
    run_on_ranks(*run, timeout_s=60, init_process_group=False)
    threads = [(tmp_path / str(rank)).read_text() for rank in (0, 1)]
    assert threads == [omp_num_threads or "1"] * 2
