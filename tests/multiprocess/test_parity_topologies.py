"""Parity without packing, and the plug-in against torchtitan's own job.

Settings and environment variables: ``parity_suites.py``. The packed CP
suites are in ``test_parity_cp.py``; the upstream pair (1 rank) runs in
``test_resume.py``, on the runs it resumes from.
"""

import os
import subprocess

import pytest

from torchtitan_ext.tools.parity import (
    ParityCase,
    compare,
    compare_first_moments,
    per_step_tolerances,
    read_tb_scalars,
)

from ..parity_suites import (
    FULL,
    GRAD_NORM_TOL,
    LOSS_TOL,
    STEPS,
    TIMEOUT_S,
    UNPACKED,
    assert_pair,
    assert_passed,
    images_per_batch,
    run_suite,
    toml_spec,
    upstream_spec,
)
from ..training_runs import REPO

# fp32 gradients of one step, relative to the largest entry of the tensor.
GRAD_REL_TOL = 1e-4

CP2_PTRR = (
    "--parallelism.context_parallel_degree 2 "
    "--parallelism.context_parallel_load_balancer ptrr "
    "--parallelism.context_parallel_ptrr_mask_key global"
)
SHARDED_VISION = "--parallelism.context_parallel_vision sharded"


# Unpacked suites: no tight steps; the control bounds every step, and the first
# moments after step 2 the gradients.
_UNPACKED_RULES = dict(
    tight_steps=0, control_factor=1.0, moment_step=2, moment_tol=GRAD_REL_TOL
)


def _grad_accum_control(seq_len: int):
    """The 1-rank job with its two rows summed in two halves: the same samples."""
    return toml_spec(
        "default.toml",
        f"--training.seq_len {seq_len} --training.local_batch_size 1 "
        "--training.global_batch_size 2",
    )


def test_unpacked_one_rank_vs_cp2(tmp_path, seed_checkpoint):
    """Packing off: 1 rank vs CP2 (ptrr), per parameter and over STEPS steps.

    Unpacked rows are mostly padding (about 46 label tokens per step), and the
    seed's final norm starts at zero, so step 1 trains only that norm and step
    2's gradients are ~1e-5 with many entries at rounding level, where AdamW's
    update (m / (sqrt(v) + eps)) turns a 1e-10 change of summation order into
    an lr-sized step. The curves then drift by more than the packed rows'
    tolerances under any change of reduction order: the same 1-rank job with
    its batch summed in two halves (gradient accumulation, same samples) is the
    control. So CP2 must (a) give every parameter the 1-rank gradient to fp32
    rounding, read from AdamW's first moments after step 2 (relative to each
    tensor's largest entry); and (b) drift no more than the shared tolerances
    or the control, whichever is larger, at every step.
    """
    results = run_suite(
        tmp_path,
        "unpacked",
        toml_spec("default.toml", UNPACKED),
        {
            "grad_accum_control": _grad_accum_control(256),
            "cp2_ptrr": ParityCase(
                toml_spec("default.toml", f"{UNPACKED} {CP2_PTRR}"),
                control="grad_accum_control",
            ),
        },
        seed_checkpoint=seed_checkpoint,
        **_UNPACKED_RULES,
    )
    assert_passed(results, drifting_control="grad_accum_control")
    vision = [
        key
        for key, error in results["cp2_ptrr"].moments.errors.items()
        if ".vision_" in key
    ]
    assert vision, "no vision parameter's first moment was compared"


# Unpacked rows of 512 tokens (CP4's smallest valid length), one image each.
UNPACKED_512 = "--training.seq_len 512 --training.local_batch_size 2"
CP4_PTRR = CP2_PTRR.replace("degree 2", "degree 4")


def test_unpacked_cp4_sharded_vision_fewer_images_than_ranks(
    tmp_path, embedded_assets, seed_checkpoint
):
    """Two images a step over four CP ranks: two ranks encode a blank image.

    Sharded vision gives ranks 0 and 1 an image each and ranks 2 and 3 an
    empty share; CP4 with sharded vision must still match 1 rank and the
    replicated CP4 run, by the unpacked suite's rules (its docstring says why
    unpacked rows need the gradient-accumulation control); sharded against
    replicated by twice the control's drift (below) and the first moments.
    CI (``FULL`` off) leaves out the replicated run: packed CP4
    (``test_parity_cp.py``) runs its path.
    """
    images = images_per_batch(
        embedded_assets, seq_len=512, local_batch_size=2, batches=STEPS, packed=False
    )
    assert all(0 < n < 4 for n in images), images
    results = run_suite(
        tmp_path,
        "unpacked_cp4",
        toml_spec("default.toml", UNPACKED_512),
        {
            "grad_accum_control": _grad_accum_control(512),
            **{
                name: ParityCase(
                    toml_spec("default.toml", f"{UNPACKED_512} {CP4_PTRR} {mode}"),
                    control="grad_accum_control",
                )
                for name, mode in (
                    ("cp4_sharded_vision", SHARDED_VISION),
                    *([("cp4_replicated_vision", "")] if FULL else []),
                )
            },
        },
        seed_checkpoint=seed_checkpoint,
        **_UNPACKED_RULES,
    )
    assert_passed(results, drifting_control="grad_accum_control")
    if not FULL:
        return
    replicated, sharded = (
        results[f"cp4_{mode}_vision"] for mode in ("replicated", "sharded")
    )
    # Each mode is within the control's drift of 1 rank, on either side of it
    # (10 steps, step 8: replicated -1.7e-5, sharded +1.7e-5 in the loss), so
    # the two are within twice that drift of each other.
    loss_tol, grad_norm_tol = per_step_tolerances(
        loss_tol=LOSS_TOL,
        grad_norm_tol=GRAD_NORM_TOL,
        steps=STEPS,
        tight_steps=0,
        control=results["grad_accum_control"].rows,
        control_factor=2.0,
    )
    pair = compare(
        replicated.test,
        sharded.test,
        loss_tol=loss_tol,
        grad_norm_tol=grad_norm_tol,
        expected_steps=STEPS,
    )
    moments = compare_first_moments(
        replicated.checkpoint, sharded.checkpoint, tol=GRAD_REL_TOL
    )
    assert_pair("unpacked_cp4 replicated vs sharded", pair, moments)


@pytest.mark.parametrize(
    ("toml", "degree"),
    [
        ("fsdp2_unpacked.toml", "--parallelism.data_parallel_shard_degree 2"),
        ("tp2_sp_unpacked.toml", "--parallelism.tensor_parallel_degree 2"),
    ],
)
def test_plugin_is_bitwise_upstream(
    tmp_path, embedded_assets, seed_checkpoint, toml, degree
):
    """The plug-in's non-CP job is torchtitan's own, bit for bit, on 2 ranks."""
    results = run_suite(
        tmp_path,
        toml.removesuffix(".toml"),
        upstream_spec(embedded_assets, 2, f"{UNPACKED} {degree}"),
        {"plugin": toml_spec(toml, UNPACKED)},
        seed_checkpoint=seed_checkpoint,
        exact=True,
    )
    assert_passed(results)


def test_pp2_trains_unpacked(tmp_path):
    """PP2 (1F1B, 2 ranks) trains unpacked samples; PP parity: test_parity_pipeline."""
    dump = tmp_path / "pp2"
    run = subprocess.run(
        [
            str(REPO / "run_train.sh"),
            f"--dump_folder={dump}",
            *UNPACKED.split(),
            "--metrics.enable_tensorboard",
            f"--training.steps={STEPS}",
        ],
        env={
            **os.environ,
            "NGPU": "2",
            "CONFIG_FILE": str(REPO / "train_configs" / "pp2_unpacked.toml"),
        },
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    losses = read_tb_scalars(dump / "tb").loss
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1], losses
