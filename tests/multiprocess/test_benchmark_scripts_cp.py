"""The CP benchmark scripts drive the real CP2 Trainer at a tiny size and write JSON."""

import json
import subprocess
import sys

import pytest

from ..training_runs import REPO

_TINY = ("--seq-len", "256", "--local-batch-size", "1", "--warmup", "0")


def _run(tmp_path, script: str, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"{script}.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / f"{script}.py"),
            *_TINY,
            *args,
            *("--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads(out.read_text()), run.stdout


def test_preprocessing_overhead_runs(tmp_path):
    result, stdout = _run(
        tmp_path, "preprocessing_overhead", "--steps", "1", "--pairs", "3"
    )
    assert (result["cp"], result["seq_len"], result["device"]) == (2, 256, "cpu")
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        (step,) = r["steps"]
        assert step["images"] > 0 and step["image_tokens"] > 0
        assert len(step["added_ms_pairs"]) == 3
        assert len(step["added_cpu_ms_pairs"]) == 3
        assert len(r["added_ms_quartiles_all_pairs"]) == 3
        assert 0 < r["upstream_post_ms"] < r["step_ms"]
        assert 0 < r["plugin_post_ms"] < r["step_ms"]
        assert r["check_ms"] > 0 and r["index_ms"] > 0
        assert r["added_pct_of_step"] == pytest.approx(
            100 * r["added_ms"] / r["step_ms"]
        )
        assert f"| {r['rank']} | {r['upstream_post_ms']:.2f} |" in stdout


def test_host_syncs_runs(tmp_path):
    result, stdout = _run(tmp_path, "host_syncs", "--steps", "1")
    assert (result["cp"], result["ranks"]) == (2, 2)
    in_scope = result["in_target_phases_by_owner"]
    # The plug-in's post-processing, gather and vision sharding read no values.
    plugin_syncs = [
        row
        for row in result["rows"]
        if row["owner"] == "torchtitan_ext" and row["phase"] in result["target_phases"]
    ]
    assert plugin_syncs == [], plugin_syncs
    assert in_scope["torchtitan_ext"] == [0, 0]
    assert all(count > 0 for count in in_scope["torchtitan"])
    tt_sites = {
        row["site"]
        for row in result["rows"]
        if row["owner"] == "torchtitan" and row["phase"] in result["target_phases"]
    }
    assert any("vision_encoder.py" in site for site in tt_sites), tt_sites
    # The counter does see the plug-in: its placeholder check reads the CPU batch.
    assert all(c > 0 for c in result["totals"]["batch_generator"]["torchtitan_ext"])
    assert "| batch_generator | torchtitan_ext | `torchtitan_ext/" in stdout
    # The zero above is not a phase that never ran under the modes.
    assert all(ops["post_dataloading_process"] > 0 for ops in result["ops_seen"])
    assert all(ops["forward+backward"] > 0 for ops in result["ops_seen"])
