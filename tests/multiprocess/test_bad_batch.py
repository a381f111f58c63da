"""A batch whose placeholders and images disagree fails every CP rank, no hang."""

import os
import subprocess
import time

import pytest

from ..training_runs import REPO
from ..unit.test_validator import dataset_with_stray_placeholder

TIMEOUT_S = 300


@pytest.mark.parametrize("vision", ["replicated", "sharded"])
def test_mismatch_fails_all_cp_ranks_with_both_counts(tmp_path, vision):
    dataset = dataset_with_stray_placeholder(tmp_path / "data")
    env = {**os.environ, "NGPU": "2", "LOG_RANK": "0,1"}
    env["CONFIG_FILE"] = str(REPO / "train_configs" / "cp2.toml")
    start = time.monotonic()
    run = subprocess.run(
        [
            str(REPO / "run_train.sh"),
            f"--dump_folder={tmp_path / 'out'}",
            f"--dataloader.dataset_path={dataset}",
            "--dataloader.packing_buffer_size=0",
            "--training.seq_len=256",
            "--training.steps=3",
            f"--parallelism.context_parallel_vision={vision}",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    took = time.monotonic() - start
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    for rank in (0, 1):
        errors = [
            line
            for line in output.splitlines()
            if line.startswith(f"[rank{rank}]:") and "Multimodal batch mismatch" in line
        ]
        assert errors, f"rank {rank} did not report the mismatch:\n{output[-3000:]}"
        assert "image placeholder tokens in" in errors[0]
        assert "but the vision-feature bank has" in errors[0]
    assert took < TIMEOUT_S
