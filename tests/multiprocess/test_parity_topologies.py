"""Numerical parity of every supported non-pipeline topology, from real runs.

Settings and environment variables: ``parity_suites.py``. The CP2, FSDP2 x CP2
and upstream pairs run in ``test_resume.py``, on the runs it resumes from.
"""

import os
import subprocess
from pathlib import Path

import pytest

from torchtitan_ext.tools.parity import RunSpec, read_tb_scalars

from ..parity_suites import (
    GRAD_NORM_TOL,
    LOSS_TOL,
    STEPS,
    TIMEOUT_S,
    UNPACKED,
    assert_passed,
    output_dir,
    run_suite,
    toml_spec,
    upstream_data_options,
    upstream_spec,
)
from ..training_runs import REPO, checkpoint_path, checkpoint_tensors, run_train

# fp32 gradients of one step, relative to the largest entry of the tensor.
GRAD_REL_TOL = 1e-4
_RUN = {"timeout_s": TIMEOUT_S}

CP2_PTRR = (
    "--parallelism.context_parallel_degree 2 "
    "--parallelism.context_parallel_load_balancer ptrr "
    "--parallelism.context_parallel_ptrr_mask_key global"
)


def _assert_suite(
    tmp_path: Path, suite: str, baseline: RunSpec, tests: dict, **kwargs
) -> None:
    assert_passed(run_suite(tmp_path, suite, baseline, tests, **kwargs))


def test_packed_one_rank_vs_cp2_balancers_cp4(tmp_path):
    """1 rank vs CP2 with the other balancers, ptrr typechecked, and CP4.

    1 rank vs upstream (bitwise), CP2 (ptrr) and FSDP2 vs FSDP2 x CP2 are
    compared on the runs ``test_resume.py`` resumes from.
    """
    _assert_suite(
        tmp_path,
        "packed",
        toml_spec("packed.toml", 1),
        {
            "cp2_headtail": toml_spec(
                "cp2.toml", 2, "--parallelism.context_parallel_load_balancer headtail"
            ),
            "cp2_none": toml_spec(
                "cp2.toml", 2, "--parallelism.context_parallel_load_balancer None"
            ),
            "cp2_ptrr_typechecked": RunSpec(
                module="torchtitan_ext.muse_glimmer",
                config="muse_glimmer_debugmodel_mm_cp2_typechecked",
                ngpu=2,
            ),
            "cp4_ptrr": toml_spec("cp4.toml", 4),
        },
    )


def test_unpacked_one_rank_vs_cp2(tmp_path):
    """Packing off: 1 rank vs CP2 (ptrr), gradients per parameter and STEPS steps.

    Unpacked rows are mostly padding (about 46 label tokens per step), and the
    seed's final norm starts at zero, so step 1 trains only that norm and step
    2's gradients are ~1e-5 with many entries at rounding level, where AdamW's
    update (m / (sqrt(v) + eps)) turns a 1e-10 change of summation order into
    an lr-sized step. The curves then drift by more than the packed rows'
    tolerances under any change of reduction order: the same 1-rank job with
    its batch summed in two halves (gradient accumulation, same samples) is the
    control. So CP2 must (a) give every parameter the 1-rank gradient to fp32
    rounding, read from AdamW's first moment: after step 1 (only the final norm
    has a gradient) and after step 2 (every parameter; the weights it starts
    from differ only in that norm, by ~1e-10); and (b) drift no more than the
    tolerances or the control, whichever is larger.
    """
    out = output_dir(tmp_path, "unpacked")
    results = run_suite(
        tmp_path,
        "unpacked",
        toml_spec("default.toml", 1, UNPACKED),
        {
            "cp2_ptrr": toml_spec("default.toml", 2, f"{UNPACKED} {CP2_PTRR}"),
            "grad_accum_control": toml_spec(
                "default.toml",
                1,
                "--training.seq_len 256 --training.local_batch_size 1 "
                "--training.global_batch_size 2",
            ),
        },
    )
    cp2, control = results["cp2_ptrr"], results["grad_accum_control"]
    assert len(cp2.rows) == len(control.rows) == STEPS
    # A control this far off would mean the job itself is broken.
    assert control.max_dloss < 1e-3 and control.max_dgrad_norm < 1e-2
    assert cp2.max_dloss <= max(LOSS_TOL, control.max_dloss)
    assert cp2.max_dgrad_norm <= max(GRAD_NORM_TOL, control.max_dgrad_norm)

    seed = out / "seed" / "checkpoint" / "step-0"
    args = [
        *UNPACKED.split(),
        "--training.mixed_precision_param=float32",
        "--debug.deterministic",
        "--debug.seed=42",
        "--training.steps=2",
        "--checkpoint.enable",
        "--checkpoint.interval=1",
        "--checkpoint.no-last_save_model_only",
        f"--checkpoint.initial_load_path={seed}",
        "--checkpoint.initial_load_model_only",
    ]
    dumps = {
        "1rank": run_train(out, "grads_1rank", 1, "default.toml", args, **_RUN),
        "cp2": run_train(
            out, "grads_cp2", 2, "default.toml", [*args, *CP2_PTRR.split()], **_RUN
        ),
    }
    for step in (1, 2):
        ref, got = (
            checkpoint_tensors(checkpoint_path(dump, step)) for dump in dumps.values()
        )
        first_moments = [key for key in ref if key.endswith(".exp_avg")]
        assert len(first_moments) > 100 and set(first_moments) <= set(got)
        for key in first_moments:
            scale = ref[key].abs().max().item()
            error = (got[key] - ref[key]).abs().max().item()
            assert error <= GRAD_REL_TOL * scale, (step, key, error, scale)
        vision = [k for k in first_moments if ".vision_" in k and ref[k].any()]
        assert step == 1 or vision, "no vision parameter received a gradient"


def test_tp2_sp_vs_tp2_cp2_sp(tmp_path):
    """TP2+SP vs TP2+CP2+SP, with spmd typechecking off and on."""
    _assert_suite(
        tmp_path,
        "tp2_sp",
        toml_spec("tp2_sp.toml", 2),
        {
            "tp2_cp2_sp": toml_spec("tp2_cp2_sp.toml", 4),
            "tp2_cp2_sp_typechecked": RunSpec(
                module="torchtitan_ext.muse_glimmer",
                config="muse_glimmer_debugmodel_mm_tp2_cp2_sp_typechecked",
                ngpu=4,
            ),
        },
    )


@pytest.mark.parametrize(
    ("toml", "degree"),
    [
        ("fsdp2_unpacked.toml", "--parallelism.data_parallel_shard_degree 2"),
        ("tp2_sp_unpacked.toml", "--parallelism.tensor_parallel_degree 2"),
    ],
)
def test_plugin_is_bitwise_upstream(tmp_path, embedded_assets, toml, degree):
    """The plug-in's non-CP job is torchtitan's own, bit for bit, on 2 ranks."""
    _assert_suite(
        tmp_path,
        toml.removesuffix(".toml"),
        upstream_spec(embedded_assets, 2, f"{UNPACKED} {degree}"),
        {"plugin": toml_spec(toml, 2, UNPACKED)},
        seed_options=upstream_data_options(embedded_assets),
        exact=True,
    )


def test_pp2_trains_ten_steps(tmp_path):
    """PP2 (1F1B, 2 ranks) trains unpacked samples; PP parity: test_parity_pipeline."""
    dump = tmp_path / "pp2"
    run = subprocess.run(
        [
            str(REPO / "run_train.sh"),
            f"--dump_folder={dump}",
            *UNPACKED.split(),
            "--metrics.enable_tensorboard",
            "--training.steps=10",
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
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1], losses
