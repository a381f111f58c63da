"""The memory planner (``torchtitan_ext.tools.estimate``) on the debug job, and the
ranks it picks on a production job.

The debug job runs at CP2 on 2 simulated ranks, 512 tokens per row holding 8
images, once per vision mode: the figures must be those of the job's real
parameters sharded by FSDP over dp_shard x cp, and sharded vision must halve
the vision activations without changing the decoder's. (Agreement with the
real measurement, ``benchmarks/memory_per_rank.py --planned``, takes minutes.)
"""

import contextlib
import copy
import io
import json

import pytest
import torch

from torchtitan_ext import cpu_backend
from torchtitan_ext.config_file import load_job
from torchtitan_ext.tools.estimate import cli
from torchtitan_ext.tools.estimate.batch import image_size, synthetic_batch
from torchtitan_ext.tools.estimate.planner import ranks_to_plan

from ..jobs import TRAIN_CONFIGS

_DEBUG_JOB = [
    *("--job.config_file", str(TRAIN_CONFIGS / "cp2.toml")),
    *("--training.seq_len", "512"),
    *("--training.local_batch_size", "1"),
]
_IMAGES = 8
_TOKENS_PER_IMAGE = 16


@pytest.fixture(scope="module", autouse=True)
def _cpu_backend():
    cpu_backend.apply()


def _parameter_bytes(config) -> int:
    """The model's parameter bytes, unsharded: FSDP keeps float32 master weights."""
    model_config = copy.deepcopy(config.model_spec.model)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The replicated plan through ``plan_job``; the sharded one through the CLI."""
    config = load_job(_DEBUG_JOB)
    _, _, replicated = cli.plan_job(
        config, images=_IMAGES, tokens_per_image=_TOKENS_PER_IMAGE, world_size=2
    )
    out = tmp_path_factory.mktemp("planner") / "plan.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main(
            [
                *_DEBUG_JOB,
                *("--parallelism.context_parallel_vision", "sharded"),
                *("--images", str(_IMAGES)),
                *("--tokens-per-image", str(_TOKENS_PER_IMAGE)),
                *("--world-size", "2", "--json", str(out)),
            ]
        )
    return config, replicated, json.loads(out.read_text()), printed.getvalue()


def test_state_is_the_models_parameters_sharded_over_dp_shard_cp(plans):
    config, (estimate,), _, _ = plans
    total = _parameter_bytes(config)
    # FSDP pads each parameter's dim 0 to a multiple of the 2 shards.
    assert total / 2 <= estimate.parameters <= total / 2 * 1.01
    assert estimate.gradients == estimate.parameters
    # AdamW: two float32 moments per parameter, and a step count each.
    assert 2 * estimate.parameters <= estimate.optimizer
    assert estimate.optimizer <= 2 * estimate.parameters * 1.01
    assert estimate.peak >= (
        estimate.parameters
        + estimate.optimizer
        + estimate.decoder_activations
        + estimate.vision_activations
    )


def test_sharded_vision_halves_the_vision_activations_at_cp2(plans):
    _, (replicated,), sharded, printed = plans
    # 8 equal images: each CP rank encodes 4, so one rank stands for both.
    (row,) = sharded["rows"]
    assert replicated.images_encoded == _IMAGES
    assert row["images_encoded"] == _IMAGES // 2
    assert 0.4 < row["vision_activations"] / replicated.vision_activations < 0.6
    assert row["decoder_activations"] == pytest.approx(
        replicated.decoder_activations, rel=0.05
    )
    assert replicated.vision_activations > 0 and replicated.decoder_activations > 0
    assert row["in_flight"] == 1 and row["peak"] == row["measured_peak"]
    assert "vision sharded" in printed and "| decoder act. MiB |" in printed


def test_production_pp_job_plans_each_stage_and_each_vision_share():
    """FSDP4 x CP4 x TP2 x PP4, 1 image: stage 0 on the CP rank that encodes it
    and on one that encodes none; the later stages (no vision) on CP rank 0."""
    config = load_job(
        [
            "--job.config_file",
            "train_configs/30b_mm_fsdp4_cp4_tp2_pp4_sp_sharded_vision.toml",
        ]
    )
    size = image_size(
        config.model_spec.model.vision_encoder,
        seq_len=config.training.seq_len,
        images=1,
        tokens_per_image=None,
    )
    batch, _ = synthetic_batch(
        config.model_spec.model,
        rows=1,
        seq_len=config.training.seq_len,
        images=1,
        size=size,
    )
    # Global rank = ((pp * 4 + dp_shard) * 4 + cp) * 2 + tp.
    assert ranks_to_plan(config, 128, batch["grid_thw"]) == [0, 2, 32, 64, 96]
    config.parallelism.context_parallel_vision = "replicated"
    assert ranks_to_plan(config, 128, batch["grid_thw"]) == [0, 32, 64, 96]
