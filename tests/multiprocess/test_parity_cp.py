"""Numerical parity of every CP topology on packed sequences, and planted bugs.

One suite trains the 1-rank packed baseline once from one seed checkpoint;
every CP job is compared with it, and also with its sharpest baseline, a
job without CP that computes the same global batch (TP2+SP for TP2+CP2+SP,
PP2 for CP2xPP2, TP2xPP2+SP for TP2xCP2xPP2+SP). A job with sharded vision
is compared with 1 rank and with the same job in replicated mode. The same
comparison holds each run to ``CP_BOUNDS``: tight bounds over steps 1-2,
later steps bounded by the TP2+SP run (the same math as 1 rank, reordered
across ranks), and every parameter's first moment after step 2. Five bugs a
CP change could ship are planted in runs of the same suite
(``tests/planted_bugs.py``); each must be flagged. FSDP2xCP2 is compared
with FSDP2 in ``test_resume.py``, on the runs it resumes from: two data
ranks read other samples than one rank.
TP2xCP2xPP2+SP's resume (CP2xPP2's in CI) is checked here, on its suite
run. The CP jobs compiled (``--compile.enable``, both vision
modes, TP2+CP2+SP; ``tests/compile_report.py`` says what compiles and with
which backend) are in the suite too: against 1 rank, against the same job
eager, and with dynamo's graph breaks and recompilations counted on every rank.
CI (fewer steps, ``FULL`` off) leaves out CP2 compiled (TP2+CP2+SP compiled
runs its replicated vision path, with TP) and packed CP4 with sharded vision
(CP2's packed sharded vision and unpacked CP4's in ``test_parity_topologies.py``
run its paths).
"""

import shutil
from collections import Counter
from pathlib import Path

import pytest

from torchtitan_ext.tools.parity import (
    ParityCase,
    ParityResult,
    compare,
    compare_first_moments,
    launch_run,
    read_tb_scalars,
)

from ..compile_report import (
    COMPILE,
    REPORT_ENV,
    SHAPE_RECOMPILES,
    VARIANT_RECOMPILES,
    cause,
    read_reports,
    summarize,
)
from ..jobs import toml_ranks
from ..parity_suites import (
    CP_BOUNDS,
    FULL,
    GRAD_NORM_TOL,
    LOSS_TOL,
    STEPS,
    TIMEOUT_S,
    cp_step_tolerances,
    maxima,
    moments_line,
    run_suite,
    toml_spec,
)
from ..planted_bugs import PLANTED_BUGS
from ..training_runs import REPO

CONTROL = "tp2_sp"
HEADTAIL = "--parallelism.context_parallel_load_balancer headtail"
SHARDED_VISION = "--parallelism.context_parallel_vision sharded"


# The CP2 options a planted bug needs to show (default: cp2.toml's own).
PLANTED_BUG_OPTIONS = {
    "image_rows_off_by_one_at_a_shard_boundary": HEADTAIL,
    "exchange_backward_keeps_local_rows": SHARDED_VISION,
}


def _planted(bug: str) -> ParityCase:
    """CP2 with ``bug`` planted, 2 steps: the tight bounds and the moments judge."""
    spec = toml_spec("cp2.toml", PLANTED_BUG_OPTIONS.get(bug, ""))
    spec.env = {
        "TRAIN_FILE": "tests.planted_bugs",
        "TORCHTITAN_EXT_PLANTED_BUG": bug,
        "PYTHONPATH": str(REPO),
    }
    return ParityCase(spec, steps=2, control=CONTROL)


# Sharpest baseline of each CP job, when it is not the 1-rank run.
SHARPEST = {
    # Sharded vision: the same job with every CP rank encoding every image.
    "cp2_sharded_vision_typechecked": "cp2_ptrr_typechecked",
    "cp4_sharded_vision": "cp4_ptrr",
    "tp2_cp2_sp_sharded_vision_typechecked": "tp2_cp2_sp_typechecked",
    "cp2_pp2_sharded_vision": "cp2_pp2",
    "tp2_cp2_sp_typechecked": "tp2_sp",
    "cp2_pp2": "pp2",
    "cp2_pp2_interleaved": "pp2",
    "tp2_cp2_pp2_sp": "tp2_pp2_sp",
    # Compiled: the same job eager (typechecking changes no number).
    "cp2_compiled": "cp2_ptrr_typechecked",
    "cp2_sharded_vision_compiled": "cp2_sharded_vision_typechecked",
    "tp2_cp2_sp_compiled": "tp2_cp2_sp_typechecked",
}
# Compiled jobs: TOML and options; trained through tests/compile_report.py.
COMPILED_JOBS = {
    "cp2_compiled": ("cp2.toml", ""),
    "cp2_sharded_vision_compiled": ("cp2.toml", SHARDED_VISION),
    "tp2_cp2_sp_compiled": ("tp2_cp2_sp.toml", ""),
}
CP_JOBS = {
    "cp2_ptrr_typechecked": toml_spec("cp2_typechecked.toml"),
    "cp2_headtail": toml_spec("cp2.toml", HEADTAIL),
    "cp2_none": toml_spec(
        "cp2.toml", "--parallelism.context_parallel_load_balancer None"
    ),
    "cp4_ptrr": toml_spec("cp4.toml"),
    "cp2_sharded_vision_typechecked": toml_spec("cp2_typechecked.toml", SHARDED_VISION),
    "cp4_sharded_vision": toml_spec("cp4.toml", SHARDED_VISION),
    "tp2_cp2_sp_typechecked": toml_spec("tp2_cp2_sp_typechecked.toml"),
    "tp2_cp2_sp_sharded_vision_typechecked": toml_spec(
        "tp2_cp2_sp_typechecked.toml", SHARDED_VISION
    ),
    "cp2_pp2": toml_spec("cp2_pp2.toml"),
    "cp2_pp2_sharded_vision": toml_spec("cp2_pp2.toml", SHARDED_VISION),
    "cp2_pp2_interleaved": toml_spec("cp2_pp2_interleaved.toml"),
    "tp2_cp2_pp2_sp": toml_spec("tp2_cp2_pp2_sp.toml"),
}
NON_CP_JOBS = {
    "pp2": toml_spec("pp2.toml"),
    "tp2_pp2_sp": toml_spec("tp2_pp2_sp.toml"),
}
if not FULL:  # CI: the module docstring says why these two may go
    for jobs in (SHARPEST, COMPILED_JOBS, CP_JOBS):
        jobs.pop("cp2_compiled", None)
        jobs.pop("cp4_sharded_vision", None)


def _compiled(name: str, reports: Path) -> ParityCase:
    toml, options = COMPILED_JOBS[name]
    spec = toml_spec(toml, f"{COMPILE} {options}".strip())
    spec.env = {
        "TRAIN_FILE": "tests.compile_report",
        "PYTHONPATH": str(REPO),
        REPORT_ENV: str(reports / name),
    }
    return ParityCase(spec, control=CONTROL)


@pytest.fixture(scope="module")
def compile_reports(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compile_reports")


@pytest.fixture(scope="module")
def packed(
    tmp_path_factory, hf_seed_checkpoint, compile_reports
) -> dict[str, ParityResult]:
    """The packed suite: control, every CP job, its non-CP baselines, the bugs.

    Every run starts from the seed in Hugging Face format, as users start
    from the released weights (``--checkpoint.initial_load_in_hf``): every CP
    topology loads it through torchtitan's adapter into its own sharding.
    """
    tests = {
        # The control is held to the tight bounds below, not by the suite.
        CONTROL: ParityCase(
            toml_spec("tp2_sp.toml"), loss_tol=LOSS_TOL, grad_norm_tol=GRAD_NORM_TOL
        ),
        **{
            name: ParityCase(spec, control=CONTROL)
            for name, spec in NON_CP_JOBS.items()
        },
        **{name: ParityCase(spec, control=CONTROL) for name, spec in CP_JOBS.items()},
        **{name: _compiled(name, compile_reports) for name in COMPILED_JOBS},
        **{f"planted_{bug}": _planted(bug) for bug in PLANTED_BUGS},
    }
    return run_suite(
        tmp_path_factory.mktemp("parity"),
        "packed",
        toml_spec("packed.toml"),
        tests,
        seed_checkpoint=hf_seed_checkpoint,
        **CP_BOUNDS,
    )


def test_the_control_is_one_rank_reordered(packed):
    """TP2+SP: tight over steps 1-2, the shared tolerances after, same moments."""
    control = packed[CONTROL]
    tight = CP_BOUNDS["tight_steps"]
    steps = range(1, STEPS + 1)
    early_and_late = compare(
        control.baseline,
        control.test,
        loss_tol={s: CP_BOUNDS["loss_tol"] if s <= tight else LOSS_TOL for s in steps},
        grad_norm_tol={
            s: CP_BOUNDS["grad_norm_tol"] if s <= tight else GRAD_NORM_TOL
            for s in steps
        },
        expected_steps=STEPS,
    )
    print(f"packed/{CONTROL}: {maxima(control)}, {moments_line(control)}")
    assert early_and_late.passed, early_and_late.failures
    assert control.passed, control.failures


@pytest.mark.parametrize("name", [*NON_CP_JOBS, *CP_JOBS, *COMPILED_JOBS])
def test_matches_one_rank(packed, name):
    """Each job vs 1 rank: per-step bounds and every first moment."""
    result = packed[name]
    print(f"packed/{name}: {maxima(result)}, {moments_line(result)}")
    assert result.passed, result.failures
    assert len(result.rows) == STEPS


@pytest.mark.parametrize(("name", "baseline"), SHARPEST.items())
def test_matches_its_sharpest_baseline(packed, name, baseline):
    """Each CP job vs the same job without CP, by the same bounds and moments."""
    for run in (baseline, name):
        assert packed[run].test is not None, (run, packed[run].failures)
    loss_tol, grad_norm_tol = cp_step_tolerances(packed[CONTROL].rows)
    pair = compare(
        packed[baseline].test,
        packed[name].test,
        loss_tol=loss_tol,
        grad_norm_tol=grad_norm_tol,
        expected_steps=STEPS,
    )
    moments = compare_first_moments(
        packed[baseline].checkpoint,
        packed[name].checkpoint,
        tol=CP_BOUNDS["moment_tol"],
    )
    print(
        f"packed/{baseline} vs {name}: {maxima(pair)}, "
        f"first moments max {moments.max_error:.3e}"
    )
    assert pair.passed, pair.failures
    assert moments.passed, moments.failures


@pytest.mark.parametrize("name", COMPILED_JOBS)
def test_compiled_has_no_graph_break_nor_recompile_after_step_2(
    packed, compile_reports, name
):
    """Every rank: no graph break, no cache limit hit, recompiles as measured.

    Each rank's image count changes from step 1 to 2 and varies after (checked
    here, so that "no recompilation after step 2" says something; sharded
    vision changes each rank's share every step): from step 2 on the vision
    blocks are dynamic in the image count.
    """
    assert packed[name].test is not None, packed[name].failures
    by_rank = read_reports(compile_reports / name)
    print(f"packed/{name}:", *summarize(by_rank), sep="\n  ")
    toml, options = COMPILED_JOBS[name]
    ranks = toml_ranks(toml, *options.split())
    assert sorted(by_rank) == list(range(ranks)), by_rank.keys()
    for rank, report in by_rank.items():
        counts = [sum(len(i["grid_thw"]) for i in s["images"]) for s in report["steps"]]
        assert len(counts) == STEPS, (rank, counts)
        assert STEPS == 1 or counts[0] != counts[1], (rank, counts)
        assert STEPS <= 3 or len(set(counts[1:])) > 1, (rank, counts)
        assert report["graph_breaks"] == {}, (rank, report["graph_breaks"])
        assert report["limits_hit"] == [], (rank, report["limits_hit"])
        causes = Counter((e["step"], cause(e)) for e in report["recompiles"])
        expected = {(1, "variant"): VARIANT_RECOMPILES}
        if STEPS >= 2:
            expected[(2, "shape")] = SHAPE_RECOMPILES
        assert causes == expected, (rank, report["recompiles"])
        # The blocks' one code object: 1 + 6 cache entries, one short of the limit.
        assert 1 + len(report["recompiles"]) < report["recompile_limit"]
        assert report["unique_graphs"] == 1 + len(report["recompiles"]) + 1


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_planted_bug_is_flagged(packed, bug):
    """The bounds (or, for the k/v all-gather, the run itself) catch each bug."""
    result = packed[f"planted_{bug}"]
    print(f"packed/planted_{bug}: {maxima(result)}, {moments_line(result)}")
    assert not result.passed
    if bug == "vision_kv_all_gathered_over_cp":
        # Doubled keys overrun the vision block mask: this bug cannot train.
        log = result.runs[-1].log_path
        assert "block_mask was created for a smaller length" in open(log).read()
        return
    by_bounds = [
        f for f in result.failures if "_tol " in f or f.startswith("first moment")
    ]
    assert by_bounds, result.failures
    assert not any(" run failed " in f for f in result.failures), result.failures


# The pipeline job resumed: all of TP, CP and PP; in CI (``FULL`` off) the
# 4-rank CP2 x PP2 (TP's resume: CP2 into TP2+SP in ``test_resume.py``).
RESUMED_JOB = "tp2_cp2_pp2_sp" if FULL else "cp2_pp2"


def test_pipeline_job_resumes_bitwise(packed, tmp_path):
    """The job's own resume path: its full step-2 checkpoint, the same command.

    The suite's run saved its whole state after the moment step; the same
    command in a folder holding only that checkpoint must load it (not the
    seed) and train the remaining steps bitwise as the uninterrupted run.
    """
    run = packed[RESUMED_JOB]
    assert run.test is not None and run.checkpoint is not None, run.failures
    uninterrupted = run.runs[-1]
    dump = tmp_path / f"{RESUMED_JOB}_resumed"
    saved = run.checkpoint
    shutil.copytree(saved, dump / saved.parent.name / saved.name)
    argv = [
        f"--dump_folder={dump}" if arg.startswith("--dump_folder=") else arg
        for arg in uninterrupted.argv
    ]
    record = launch_run(
        dump.name,
        uninterrupted.job_env,
        argv,
        tmp_path / f"{dump.name}.log",
        timeout=TIMEOUT_S,
        echo=False,
        forked=True,
    )
    assert record.ok, record.failure()
    log = Path(record.log_path).read_text()
    assert f"Loading the checkpoint from {dump / saved.parent.name / saved.name}" in log
    (tb_folder,) = dump.glob("tb_*")
    resumed = read_tb_scalars(tb_folder)
    steps = list(range(CP_BOUNDS["moment_step"] + 1, STEPS + 1))
    assert sorted(resumed.loss) == steps
    got = [(resumed.loss[s], resumed.grad_norm[s]) for s in steps]
    want = [(run.test.loss[s], run.test.grad_norm[s]) for s in steps]
    assert got == want, (got, want)
