"""Numerical parity of every supported topology, from real multi-process runs.

Each suite trains one baseline from a seed checkpoint and compares each test run
to it (fp32 parameters, deterministic, 10 steps by default; set
``TORCHTITAN_EXT_PARITY_STEPS`` to change). ``TORCHTITAN_EXT_PARITY_OUT`` keeps the
runs, tables, JSON and plots in that folder instead of a temporary one.
"""

import os
import subprocess
from pathlib import Path

import pytest

from torchtitan_ext.embedded_data import ensure_embedded_assets
from torchtitan_ext.parity import ParityCase, RunSpec, read_tb_scalars, run_parity_suite

REPO = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("TORCHTITAN_EXT_PARITY_STEPS", "10"))
TIMEOUT_S = 1200
LOSS_TOL, GRAD_NORM_TOL = 1e-5, 1e-4

_assets = ensure_embedded_assets()
# torchtitan's own job, pointed at the embedded data.
UPSTREAM = RunSpec(
    module="muse_glimmer",
    config="muse_glimmer_debugmodel_mm",
    options=f"--hf_assets_path={_assets.tokenizer_dir} "
    f"--dataloader.dataset_path={_assets.dataset_dir}",
)
UNPACKED = "--training.seq_len 256 --training.local_batch_size 2"
PACKED = (
    "--dataloader.packing_buffer_size 32 --dataloader.max_images_per_batch 128 "
    "--training.seq_len 512 --training.local_batch_size 2"
)
CP2_PTRR = (
    "--parallelism.context_parallel_degree 2 "
    "--parallelism.context_parallel_load_balancer ptrr "
    "--parallelism.context_parallel_ptrr_mask_key global"
)


def _toml(name: str, ngpu: int, options: str = "") -> RunSpec:
    return RunSpec(
        config_file=str(REPO / "train_configs" / name), ngpu=ngpu, options=options
    )


def _upstream(ngpu: int, options: str) -> RunSpec:
    return RunSpec(
        module=UPSTREAM.module,
        config=UPSTREAM.config,
        options=f"{UPSTREAM.options} {options}",
        ngpu=ngpu,
    )


def _output_dir(tmp_path: Path, suite: str) -> Path:
    keep = os.environ.get("TORCHTITAN_EXT_PARITY_OUT")
    return Path(keep) / suite if keep else tmp_path / suite


def _assert_suite(
    tmp_path: Path, suite: str, baseline: RunSpec, tests: dict, **kwargs
) -> None:
    results = run_parity_suite(
        baseline,
        tests,
        steps=STEPS,
        output_dir=_output_dir(tmp_path, suite),
        loss_tol=LOSS_TOL,
        grad_norm_tol=GRAD_NORM_TOL,
        timeout=TIMEOUT_S,
        **kwargs,
    )
    failed = {name: r.failures for name, r in results.items() if not r.passed}
    for name, result in results.items():
        print(
            f"{suite}/{name}: max|dloss|={result.max_dloss:.3e} "
            f"max|dgrad_norm|={result.max_dgrad_norm:.3e} passed={result.passed}"
        )
        assert len(result.rows) == STEPS or name in failed
    assert not failed, failed


def test_packed_one_rank_baseline_vs_upstream_cp2_cp4(tmp_path):
    """1 rank vs upstream (bitwise), CP2 with each balancer (also typechecked), CP4."""
    _assert_suite(
        tmp_path,
        "packed",
        _toml("packed.toml", 1),
        {
            "upstream_1rank": ParityCase(_upstream(1, PACKED), exact=True),
            "cp2_ptrr": _toml("cp2.toml", 2),
            "cp2_headtail": _toml(
                "cp2.toml", 2, "--parallelism.context_parallel_load_balancer headtail"
            ),
            "cp2_none": _toml(
                "cp2.toml", 2, "--parallelism.context_parallel_load_balancer None"
            ),
            "cp2_ptrr_typechecked": RunSpec(
                module="torchtitan_ext.muse_glimmer",
                config="muse_glimmer_debugmodel_mm_cp2_typechecked",
                ngpu=2,
            ),
            "cp4_ptrr": _toml("cp4.toml", 4),
        },
    )


@pytest.mark.xfail(
    strict=True,
    reason="open: unpacked CP2 drifts past 1e-5 after step 6 (measured 1.7e-05 "
    "loss, 2.0e-04 grad norm at step 10) although steps 1-3 agree to 3e-7; the "
    "packed rows stay below 1e-6 / 4e-6",
)
def test_unpacked_one_rank_vs_cp2(tmp_path):
    """Packing off: 1 rank vs CP2 (ptrr)."""
    _assert_suite(
        tmp_path,
        "unpacked",
        _toml("default.toml", 1, UNPACKED),
        {"cp2_ptrr": _toml("default.toml", 2, f"{UNPACKED} {CP2_PTRR}")},
    )


def test_fsdp2_vs_fsdp2_cp2(tmp_path):
    _assert_suite(
        tmp_path,
        "fsdp2",
        _toml("fsdp2.toml", 2),
        {"fsdp2_cp2": _toml("fsdp2_cp2.toml", 4)},
    )


def test_tp2_sp_vs_tp2_cp2_sp(tmp_path):
    """TP2+SP vs TP2+CP2+SP, with spmd typechecking off and on."""
    _assert_suite(
        tmp_path,
        "tp2_sp",
        _toml("tp2_sp.toml", 2),
        {
            "tp2_cp2_sp": _toml("tp2_cp2_sp.toml", 4),
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
def test_plugin_is_bitwise_upstream(tmp_path, toml, degree):
    """The plug-in's non-CP job is torchtitan's own, bit for bit, on 2 ranks."""
    _assert_suite(
        tmp_path,
        toml.removesuffix(".toml"),
        _upstream(2, f"{UNPACKED} {degree}"),
        {"plugin": _toml(toml, 2, UNPACKED)},
        seed_options=UPSTREAM.options,
        exact=True,
    )


def test_pp2_trains_ten_steps(tmp_path):
    """PP2 (1F1B, 2 ranks) trains the plug-in's job; parity under PP is issue 4's."""
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
