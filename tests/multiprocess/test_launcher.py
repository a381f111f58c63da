"""run_train.sh takes the command lines torchtitan's scripts/loss_compare.py makes."""

import os
import subprocess
from pathlib import Path

from torchtitan_ext.tools.parity import read_tb_scalars

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
