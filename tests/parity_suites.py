"""Shared settings and helpers of the parity test files.

Each suite trains one baseline from the session's seed checkpoint and compares each test
run to it (fp32 parameters, deterministic, 10 steps by default; set
``TORCHTITAN_EXT_PARITY_STEPS`` to change). ``TORCHTITAN_EXT_PARITY_OUT`` keeps
the runs, tables, JSON and plots in that folder instead of a temporary one.

The CP comparisons use ``CP_BOUNDS``, set from the floors measured on the
packed debug job (fp32, deterministic, 5 steps, every CP topology): over
steps 1-2 |dloss| was at most 4.8e-7 (one float32 ulp of the loss) and
|dgrad_norm| 3.7e-8; every first moment after step 2 was within 3.6e-5 of its
tensor's largest entry (1.1e-5 without TP). The smallest planted bug, one
image's rows off by one past a shard boundary, moves the step-2 loss by 1.9e-6,
the grad norm by 1.5e-4 and a first moment by 0.75 of its tensor's scale.
"""

import dataclasses
import itertools
import os
from pathlib import Path

from torchtitan_ext.tools.parity import (
    ParityResult,
    RunSpec,
    StepRow,
    per_step_tolerances,
    run_parity_suite,
)

from .training_runs import REPO

__all__ = [
    "GRAD_NORM_TOL",
    "LOSS_TOL",
    "PACKED",
    "STEPS",
    "CP_BOUNDS",
    "FP32",
    "FULL",
    "TIMEOUT_S",
    "UNPACKED",
    "upstream_data_options",
    "assert_passed",
    "cp_step_tolerances",
    "images_per_batch",
    "maxima",
    "moments_line",
    "output_dir",
    "run_suite",
    "toml_spec",
    "upstream_spec",
]

STEPS = int(os.environ.get("TORCHTITAN_EXT_PARITY_STEPS", "10"))
# The acceptance runs (10 steps) train every job. CI's shorter runs leave out
# the few jobs whose every code path another job of CI runs (each says which).
FULL = STEPS >= 10
TIMEOUT_S = 1200  # per run
LOSS_TOL, GRAD_NORM_TOL = 1e-5, 1e-4
CP_BOUNDS = {
    # Steps 1-2, before AdamW amplifies rounding: 2x and 8x the measured floor.
    "tight_steps": 2,
    "loss_tol": 1e-6,
    "grad_norm_tol": 3e-7,
    # Later steps: 4x the same-math control's largest difference so far.
    "control_factor": 4.0,
    # First moments after step 2, relative to each tensor's largest entry: ~4x.
    "moment_step": 2,
    "moment_tol": 2e-4,
}

UNPACKED = "--training.seq_len 256 --training.local_batch_size 2"
# bf16 matmuls are emulated on CPU: a CP2 step of cp2.toml takes ~5x fp32's (23 s
# against 4.5 s, side by side). The runs that test what a job does with bad
# input or a lost node train in fp32; the hostile-data run and PP2 unpacked
# keep the jobs' bf16 default.
FP32 = "--training.mixed_precision_param=float32"
# The plug-in's packed.toml job, as flags for upstream's job.
PACKED = (
    "--dataloader.packing_buffer_size 32 --dataloader.max_images_per_batch 128 "
    "--training.seq_len 512 --training.local_batch_size 2"
)


def upstream_data_options(assets) -> str:
    """Flags that point torchtitan's own job at the embedded ``assets``."""
    return (
        f"--hf_assets_path={assets.tokenizer_dir} "
        f"--dataloader.dataset_path={assets.dataset_dir}"
    )


def upstream_spec(assets, ngpu: int, options: str) -> RunSpec:
    """torchtitan's own muse_glimmer job, with #4244, on ``ngpu`` ranks.

    0.3.0 samples non-square images' position embeddings wrongly (fixed on
    torchtitan main by PR #4244, backported by the plug-in): its runs apply
    the fix (``tests/upstream_with_4244.py``) so that bitwise comparisons
    compare everything else.
    """
    return RunSpec(
        module="muse_glimmer",
        config="muse_glimmer_debugmodel_mm",
        options=f"{upstream_data_options(assets)} {options}",
        ngpu=ngpu,
        env={"TRAIN_FILE": "tests.upstream_with_4244"},
    )


def toml_spec(name: str, options: str = "") -> RunSpec:
    """A run of ``train_configs/<name>`` with ``options``, on the ranks they ask for."""
    return RunSpec(config_file=str(REPO / "train_configs" / name), options=options)


def assert_pair(label: str, pair, moments, note: str = "") -> None:
    """Print a comparison and its first moments' error; both must pass."""
    print(f"{label}: {maxima(pair)}, first moments max {moments.max_error:.3e}{note}")
    assert pair.passed, pair.failures
    assert moments.passed, moments.failures


def output_dir(tmp_path: Path, suite: str) -> Path:
    keep = os.environ.get("TORCHTITAN_EXT_PARITY_OUT")
    return Path(keep) / suite if keep else tmp_path / suite


def maxima(result) -> str:
    """``max|dloss|=... max|dgrad_norm|=...`` of a result or comparison."""
    if result.max_dloss is None or result.max_dgrad_norm is None:
        return "no comparison (a run failed)"
    return (
        f"max|dloss|={result.max_dloss:.3e} max|dgrad_norm|={result.max_dgrad_norm:.3e}"
    )


def run_suite(
    tmp_path: Path,
    suite: str,
    baseline: RunSpec,
    tests: dict,
    *,
    seed_checkpoint: Path,
    **kwargs,
) -> dict[str, ParityResult]:
    """``run_parity_suite`` at the suite settings above; prints every result.

    Every suite starts from the session's one ``seed_checkpoint`` (conftest).
    ``kwargs`` override the shared tolerances (``**CP_BOUNDS`` for CP suites).
    """
    settings = {"loss_tol": LOSS_TOL, "grad_norm_tol": GRAD_NORM_TOL, **kwargs}
    results = run_parity_suite(
        baseline,
        tests,
        steps=STEPS,
        seed_checkpoint=seed_checkpoint,
        output_dir=output_dir(tmp_path, suite),
        timeout=TIMEOUT_S,
        forked=True,
        **settings,
    )
    for name, result in results.items():
        print(f"{suite}/{name}: {maxima(result)} passed={result.passed}")
    return results


def assert_passed(
    results: dict[str, ParityResult], drifting_control: str | None = None
) -> None:
    """Every comparison passed; a ``drifting_control`` only has to be sane.

    On unpacked rows a same-math control drifts past the shared tolerances as
    far as rounding takes it (``test_unpacked_one_rank_vs_cp2``); it is the
    yardstick of the other cases, so of its own it must only run every step,
    keep its first moments, and stay far from a broken job's curves.
    """
    cases = dict(results)
    if drifting_control is not None:
        control = cases.pop(drifting_control)
        assert len(control.rows) == STEPS, control.failures
        assert control.moments is not None and not control.moments.failures
        assert control.max_dloss < 1e-3 and control.max_dgrad_norm < 1e-2, maxima(
            control
        )
    failed = {name: r.failures for name, r in cases.items() if not r.passed}
    assert not failed, failed
    assert all(len(r.rows) == STEPS for r in cases.values())


def moments_line(result: ParityResult) -> str:
    moments = result.moments
    if moments is None or moments.max_error is None:
        return "no first moments"
    return f"first moments max {moments.max_error:.3e}"


def cp_step_tolerances(
    control: list[StepRow], control_factor: float = CP_BOUNDS["control_factor"]
):
    """``CP_BOUNDS`` per step over ``STEPS`` steps, late steps from ``control``."""
    return per_step_tolerances(
        loss_tol=CP_BOUNDS["loss_tol"],
        grad_norm_tol=CP_BOUNDS["grad_norm_tol"],
        steps=STEPS,
        tight_steps=CP_BOUNDS["tight_steps"],
        control=control,
        control_factor=control_factor,
    )


def images_per_batch(
    assets,
    *,
    seq_len: int,
    local_batch_size: int,
    batches: int,
    packed: bool = True,
    dp_world_size: int = 1,
    dp_rank: int = 0,
) -> list[int]:
    """Images in each batch one DP rank trains on, in order, from the jobs' loader."""
    from torchtitan.components.tokenizer import MultiModalTokenizer
    from torchtitan.models.muse_glimmer.config_registry import (
        MUSE_GLIMMER_SPECIAL_TOKENS,
    )

    from torchtitan_ext.muse_glimmer.config_registry import (
        muse_glimmer_debugmodel_mm_packed,
    )

    tokenizer = MultiModalTokenizer.Config(**MUSE_GLIMMER_SPECIAL_TOKENS).build(
        tokenizer_path=str(assets.tokenizer_dir)
    )
    config = muse_glimmer_debugmodel_mm_packed().dataloader
    config = dataclasses.replace(
        config,
        dataset=assets.dataset,
        dataset_path=str(assets.dataset_dir),
        packing_buffer_size=config.packing_buffer_size if packed else 0,
    )
    loader = config.build(
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
    )
    counts = []
    for batch, _ in itertools.islice(loader, batches):
        grid_thw = batch["grid_thw"]
        counts.append(0 if grid_thw is None else grid_thw.shape[0])
    return counts
