"""benchmarks/memory_per_rank.py runs CP1 and CP2 at a tiny size and writes its JSON."""

import json
import subprocess
import sys

from ..training_runs import REPO


def test_memory_per_rank_benchmark_runs(tmp_path):
    out = tmp_path / "memory_per_rank.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "memory_per_rank.py"),
            *("--seq-len", "512", "--cp", "1", "2", "--images", "1", "4"),
            *("--tokens-per-image", "16", "--layers", "4", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| 2 | 4 | 64 |" in run.stdout
    rows = {(r["cp"], r["images"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for images in (1, 4):
        cp1, cp2 = rows[1, images], rows[2, images]
        assert len(cp2["ranks"]) == 2
        # Each CP rank holds half the tokens; the vision stack is replicated.
        assert cp2["decoder_activation_mib"] < cp1["decoder_activation_mib"]
        assert cp2["vision_activation_mib"] == cp1["vision_activation_mib"]
        assert cp1["decoder_attn_scratch_mib"] > 0
    assert rows[1, 4]["vision_activation_mib"] > rows[1, 1]["vision_activation_mib"]
