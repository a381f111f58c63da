"""The memory planner's peak against the measured peak on real ranks.

``benchmarks/planner_peak.py`` runs three debug jobs on gloo ranks (CP2 in
fp32; TP2 x CP2 + SP in bf16 with full AC; CP2 x PP2 under 1F1B with 4
microbatches) and plans each. The planned peak of every planned rank must be
within 10% of that rank's measured peak (the issue's bound; measured here:
-4.8% to +0.7%). Planted: a planner that runs one microbatch per stage, as it
did when it derived the microbatches in flight, misses the PP stages' peaks by
15-26%.
"""

import json
import subprocess
import sys

import pytest

from ..training_runs import REPO

_BENCHMARKS = REPO / "benchmarks"
_JOBS = ("cp2_fp32", "tp2_cp2_sp_bf16_full_ac", "cp2_pp2_1f1b_fp32")
_BOUND = 0.10


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("planner_peak") / "planner_peak.json"
    run = subprocess.run(
        [sys.executable, str(_BENCHMARKS / "planner_peak.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads(out.read_text())


def test_planned_peak_is_within_10_percent_of_the_measured_peak(result):
    rows = result["rows"]
    # One rank per pipeline stage; stage 0 of 1F1B over 2 stages holds 2.
    assert [(r["job"], r["stage"], r["in_flight"]) for r in rows] == [
        (_JOBS[0], 0, 1),
        (_JOBS[1], 0, 1),
        (_JOBS[2], 0, 2),
        (_JOBS[2], 1, 1),
    ]
    for row in rows:
        assert row["measured_mib"] > row["planned_mib"] * 0.5 > 0
        assert abs(row["error"]) <= _BOUND, row


def test_planted_one_microbatch_per_stage_misses_the_pp_peaks(result, monkeypatch):
    monkeypatch.syspath_prepend(str(_BENCHMARKS))
    import planner_peak

    from torchtitan_ext.tools.estimate import planner

    def one_microbatch(microbatches, in_flight):
        return [("F", 0), ("B", 0)]

    monkeypatch.setattr(planner, "schedule_order", one_microbatch)
    settings = result["settings"]
    args = planner_peak._parse_args(
        [
            *("--seq-len", str(settings["seq_len"])),
            *("--images", str(settings["images"][0])),
            *("--tokens-per-image", str(settings["tokens_per_image"])),
            *("--layers", str(settings["layers"])),
        ]
    )
    name = "cp2_pp2_1f1b_fp32"
    measured = {int(rank): row for rank, row in result["measured"][name].items()}
    rows = planner_peak.compare(name, planner_peak.plan(args, name), measured)
    assert len(rows) == 2
    for row in rows:
        assert row["error"] < -_BOUND, row
