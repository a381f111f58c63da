"""Each benchmark script runs end to end at a tiny size and writes its JSON.

The CP scripts drive the real Trainer. Times on a shared CPU host say nothing
here: only that every row and figure is there, positive and finite.
"""

import json
import math
import subprocess
import sys

import pytest

from ..training_runs import REPO

_TINY = ("--seq-len", "256", "--local-batch-size", "1", "--warmup", "0")
# The synthetic-row script (benchmarks/_harness.run_degrees): CP2, 1 and 4 images.
_TINY_ROW = ("--seq-len", "256", "--cp", "2", "--images", "1", "4")
_TINY_ROW += ("--tokens-per-image", "16", "--pairs", "2")


def _run(
    tmp_path, script: str, *args: str, tiny=_TINY, timeout: float = 300
) -> tuple[dict, str]:
    out = tmp_path / f"{script}.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / f"{script}.py"),
            *tiny,
            *args,
            *("--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads(out.read_text()), run.stdout


def test_preprocessing_overhead_runs(tmp_path):
    result, stdout = _run(
        tmp_path, "vision_time", "--scope", "preprocess", "--steps", "1", "--pairs", "3"
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


def _check_mode_times(row: dict, phases: tuple[str, ...]) -> None:
    assert (row["cp"], len(row["ranks"])) == (2, 2)
    for mode in ("replicated", "sharded"):
        for phase in phases:
            assert 0 < row[f"{mode}_{phase}"] < math.inf
        for rank in row["ranks"]:
            assert len(rank["times"][mode]) == 2  # --pairs
    low, high = row["sharded_ratio_quartiles"]
    assert 0 < low <= row["sharded_ratio"] <= high < math.inf


def test_vision_time_runs(tmp_path):
    result, stdout = _run(tmp_path, "vision_time", "--scope", "vision", tiny=_TINY_ROW)
    rows = result["rows"]
    assert [(r["images"], r["vision_tokens"]) for r in rows] == [(1, 16), (4, 64)]
    for row in rows:
        _check_mode_times(row, ("forward_ms", "backward_ms", "total_ms"))
    # The cost-balanced split: 2 images each; 1 image leaves rank 1 a blank one.
    assert rows[0]["image_ranges"] == [[0, 1], [1, 1]]
    assert rows[1]["image_ranges"] == [[0, 2], [2, 4]]
    assert "| 2 | 4 | 64 |" in stdout


def test_step_time_runs(tmp_path):
    result, stdout = _run(
        tmp_path, "vision_time", "--scope", "step", "--warmup", "0", tiny=_TINY_ROW
    )
    rows = result["rows"]
    assert [(r["images"], r["vision_tokens"]) for r in rows] == [(1, 16), (4, 64)]
    for row in rows:
        _check_mode_times(row, ("pixel_agreement_ms", "agreement_ms", "step_ms"))
        assert 0 < row["replicated_agreement_ms"] < row["replicated_step_ms"]
    assert "| 2 | 4 | 64 |" in stdout


def test_memory_per_rank_runs(tmp_path):
    """CP1 and CP2, both vision modes."""
    result, stdout = _run(
        tmp_path,
        "memory_per_rank",
        *("--seq-len", "512", "--cp", "1", "2", "--images", "1", "4"),
        *("--tokens-per-image", "16", "--layers", "4"),
        tiny=(),
        timeout=900,
    )
    assert "| 2 | 4 | sharded | 64 |" in stdout
    rows = {(r["cp"], r["images"], r["vision"]): r for r in result["rows"]}
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
    assert "| 2 | 4 |" in stdout.split("bytes exchanged")[1]


def test_vision_injection_runs(tmp_path):
    result, stdout = _run(
        tmp_path,
        "vision_injection",
        *("--seq-len", "256", "--images", "1", "4", "--dims", "16"),
        *("--tokens-per-image", "4", "--repeats", "2"),
        tiny=(),
    )
    assert "| 16 | 4 | 16 |" in stdout
    rows = result["rows"]
    assert [(r["images"], r["vision_tokens"]) for r in rows] == [(1, 4), (4, 16)]
    for r in rows:
        assert all(r[f"{side}_ms"] > 0 for side in ("upstream", "plugin"))
        assert all(r[f"{side}_peak_bytes"] > 0 for side in ("upstream", "plugin"))


def test_batch_agreement_cost_runs(tmp_path):
    """Two photos of 112x56 px (4x2 patches) in a 30B_mm row of 65536 tokens."""
    result, stdout = _run(
        tmp_path,
        "batch_agreement_cost",
        *("--images", "2", "--photo", "112x56", "--repeats", "1"),
        tiny=(),
    )
    assert (result["seq_len"], result["grid"], result["tokens_per_image"]) == (
        65536,
        [4, 8],
        8,
    )
    checks = [row["check"] for row in result["rows"]]
    assert checks[0] == "every pixel hashed (before)" and checks[-1] == "now, both"
    assert all(row["ms"] > 0 and row["pct_of_step"] > 0 for row in result["rows"])
    assert result["roofline_step_s"] > 0 and "| now, both |" in stdout
