"""benchmarks/memory_per_rank.py runs CP1 and CP2, both vision modes, at a tiny size."""

import json
import math
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
        timeout=900,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| 2 | 4 | sharded | 64 |" in run.stdout
    rows = {
        (r["cp"], r["images"], r["vision"]): r
        for r in json.loads(out.read_text())["rows"]
    }
    assert sorted(rows) == [
        (cp, images, mode)
        for cp in (1, 2)
        for images in (1, 4)
        for mode in ("replicated", "sharded")
    ]
    for images in (1, 4):
        cp1 = rows[1, images, "replicated"]
        # At CP1 the modes coincide: one measurement stands for both.
        assert [
            {**rank, "vision": "replicated"}
            for rank in rows[1, images, "sharded"]["ranks"]
        ] == cp1["ranks"]
        for mode in ("replicated", "sharded"):
            cp2 = rows[2, images, mode]
            assert len(cp2["ranks"]) == 2
            # Each CP rank holds half the tokens.
            assert cp2["decoder_activation_mib"] < cp1["decoder_activation_mib"]
            assert math.isfinite(cp2["total_ratio_vs_cp1"])
            assert cp2["total_activation_mib"] > 0
        # The replicated vision stack does not shrink with CP.
        assert (
            rows[2, images, "replicated"]["vision_activation_mib"]
            == (cp1["vision_activation_mib"])
        )
        assert cp1["decoder_attn_scratch_mib"] > 0
    assert (
        rows[1, 4, "replicated"]["vision_activation_mib"]
        > (rows[1, 1, "replicated"]["vision_activation_mib"])
    )
    # Sharded: each CP2 rank encodes 2 of the 4 images.
    sharded = rows[2, 4, "sharded"]
    assert (
        sharded["vision_activation_mib"]
        < (rows[2, 4, "replicated"]["vision_activation_mib"])
    )
    assert sharded["vision_saved_mib"] > 0
    # One all-gather forward, one reduce-scatter backward, on every rank; fp32
    # rows both ways, so the same bytes.
    for rank in sharded["ranks"]:
        assert rank["exchange_calls"] == {
            "forward/all_gather_into_tensor": 1,
            "backward/reduce_scatter_tensor": 1,
        }
        assert rank["exchange_forward_bytes"] == rank["exchange_backward_bytes"] > 0
    assert 0 < sharded["exchange_wire_mib"] < math.inf
    assert rows[2, 4, "replicated"]["exchange_forward_mib"] == 0
    assert "| 2 | 4 |" in run.stdout.split("bytes exchanged")[1]
