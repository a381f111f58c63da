"""Each benchmark script runs end to end at a tiny size and writes its JSON."""

import json
import subprocess
import sys

from ..training_runs import REPO


def test_vision_injection_benchmark_runs(tmp_path):
    out = tmp_path / "vision_injection.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "vision_injection.py"),
            *("--seq-len", "256", "--images", "1", "4", "--dims", "16"),
            *("--tokens-per-image", "4", "--repeats", "2", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| 16 | 4 | 16 |" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["images"], r["vision_tokens"]) for r in rows] == [(1, 4), (4, 16)]
    assert all(r["upstream_ms"] > 0 and r["plugin_ms"] > 0 for r in rows)
