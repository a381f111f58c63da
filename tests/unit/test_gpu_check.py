"""benchmarks/gpu_check.py's dry path on the CPU: arguments parsed, every job built.

The GPU path itself (one CUDA device, about 8 minutes) is not run by CI.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},
    )


def test_dry_run_builds_every_job(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = _run("--dry-run", "--json", str(out), "--images", "1", "32", "--steps", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    assert set(plan) == {
        *("one_rank_plugin", "one_rank_upstream", "real_step", "planned", "injection")
    }
    assert (
        sum(
            section["limit_s"]
            for name, section in plan.items()
            if name not in ("planned", "injection")
        )
        <= 480
    )
    # The two sides of the comparison: the plug-in's Trainer and model, and
    # torchtitan's own; their workers get the same arguments, less --dry-run.
    assert plan["one_rank_plugin"]["trainer"] == "MuseGlimmerTrainer.Config"
    assert plan["one_rank_plugin"]["model"] == "torchtitan_ext.muse_glimmer.model"
    assert plan["one_rank_upstream"]["trainer"] == "Trainer.Config"
    assert plan["one_rank_upstream"]["model"] == "torchtitan.models.muse_glimmer.model"
    command = plan["one_rank_upstream"]["command"]
    assert plan["one_rank_upstream"]["env"]["WORLD_SIZE"] == "1"
    assert "--dry-run" not in command
    assert command[command.index("--images") + 1 :][:2] == ["1", "32"]
    assert command[command.index("--section") + 1] == "one_rank_upstream"
    # One rank of the 30B_mm CP4 job, planned on the CPU (CUDA hidden).
    assert plan["real_step"]["job"] == "rank 0 of 32, seq_len 8192, 64 images"
    assert plan["planned"]["env"] == {"CUDA_VISIBLE_DEVICES": ""}
    assert "30b_mm_fsdp4_cp4_tp2_sp.toml" in " ".join(plan["planned"]["command"])
    assert not out.exists()


def test_bad_arguments_and_no_gpu_are_refused(tmp_path):
    run = _run("--dry-run", "--tokens-per-image", "8")
    assert run.returncode == 2 and "a square" in run.stderr
    run = _run("--json", str(tmp_path / "gpu_check.json"))
    assert run.returncode == 1 and "needs a CUDA device" in run.stderr
    assert not (tmp_path / "gpu_check.json").exists()
