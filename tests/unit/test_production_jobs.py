"""The production jobs' configs: upstream's 30B_mm job, passing or failing at start-up.

Each job (``train_configs/30b_mm_*.toml``) is torchtitan's own
``muse_glimmer_30b_mm`` with CP degrees for a cluster of 8-GPU nodes. Here
only their configs are read: every job passes what the Trainer checks before
its first collective, and near misses of them (a sequence length off the CP
grid, a TP degree the kv heads do not allow, a launch on the wrong number of
nodes, ...) fail there with a message that names the values, the plug-in's
or torchtitan's own. ``test_simulated_cluster.py`` builds and parallelizes them.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
)
from torchtitan.models.muse_glimmer import config_registry as upstream

from torchtitan_ext.config_file import ConfigFileError
from torchtitan_ext.muse_glimmer import (
    VISION_MODULE_FQNS,
    RobustMMDataLoader,
    parallelize_muse_glimmer,
)
from torchtitan_ext.muse_glimmer.config_checks import check_job_config
from torchtitan_ext.muse_glimmer.config_registry import MAX_SEQ_LEN_30B
from torchtitan_ext.muse_glimmer.trainer import MuseGlimmerTrainer
from torchtitan_ext.tools.simulated_cluster import job_world_size

from ..jobs import PRODUCTION_CONFIGS, TRAIN_CONFIGS, train_config

GPUS_32 = "30b_mm_fsdp4_cp4_tp2_sp.toml"  # 4 nodes x 8 GPUs
GPUS_32_SHARDED = "30b_mm_fsdp4_cp4_tp2_sp_sharded_vision.toml"
GPUS_128 = "30b_mm_fsdp4_cp4_tp2_pp4_sp.toml"  # 16 nodes x 8 GPUs
GPUS_128_SHARDED = "30b_mm_fsdp4_cp4_tp2_pp4_sp_sharded_vision.toml"
# Long context: seq_len 32768 to 131072 on 64 (CP8) and 128 (CP16) ranks.
LONG_CONTEXT = {
    f"30b_mm_{seq}_fsdp4_cp{cp}_tp2_sp.toml": 4 * cp * 2
    for seq in ("32k", "64k", "128k")
    for cp in (8, 16)
}


def _start_up(job, world_size: int) -> None:
    """What the Trainer checks of a job before its first collective, in order."""
    check_job_config(job, world_size)  # MuseGlimmerTrainer.init_distributed
    ParallelDims.from_config(job.parallelism, world_size)  # no mesh yet
    job.model_spec.model.update_from_config(config=job)  # the model's own checks


def test_there_are_production_jobs_on_both_clusters():
    worlds = {name: job_world_size(train_config(name)) for name in PRODUCTION_CONFIGS}
    assert worlds == {
        GPUS_32: 32,
        GPUS_32_SHARDED: 32,
        GPUS_128: 128,
        GPUS_128_SHARDED: 128,
        **LONG_CONTEXT,
    }


@pytest.mark.parametrize("name", LONG_CONTEXT)
def test_long_context_jobs_reach_the_released_models_window(name):
    """Only seq_len and RoPE's reach move: the released 131072 tokens."""
    job = train_config(name)
    assert job.training.seq_len == int(name.split("_")[2][:-1]) * 1024
    assert job.model_spec.model.max_seq_len == MAX_SEQ_LEN_30B == 131_072


@pytest.mark.parametrize("name", PRODUCTION_CONFIGS)
def test_production_job_passes_the_start_up_checks(name):
    job = train_config(name)
    _start_up(job, job_world_size(job))
    vision = "sharded" if name.endswith("_sharded_vision.toml") else "replicated"
    assert job.parallelism.context_parallel_vision == vision
    assert job.model_spec.model.context_parallel_vision == vision


@pytest.mark.parametrize("name", PRODUCTION_CONFIGS)
def test_production_job_is_upstreams_30b_mm_job(name):
    """The plug-in's Trainer, model and loader; upstream's settings and paths."""
    job = train_config(name)
    reference = upstream.muse_glimmer_30b_mm()
    assert isinstance(job, MuseGlimmerTrainer.Config)
    assert isinstance(job.dataloader, RobustMMDataLoader.Config)
    assert job.model_spec.flavor == "30B_mm"
    assert job.model_spec.parallelize_fn is parallelize_muse_glimmer
    for field in (
        "loss",  # ChunkedLossWrapper around cross-entropy over the whole vocab
        "activation_checkpoint",  # full AC
        "hf_assets_path",
        "tokenizer",
        "optimizer",
        "lr_scheduler",
        "checkpoint",
        "compile",
    ):
        assert getattr(job, field) == getattr(reference, field), field
    assert job.training == dataclasses.replace(
        reference.training,
        seq_len=job.training.seq_len,
        local_batch_size=job.training.local_batch_size,
    )
    for field in ("dataset", "dataset_path", "patch_size", "max_pixels"):
        assert getattr(job.dataloader, field) == getattr(reference.dataloader, field)
    assert job.dataloader.packing_buffer_size > 0


def test_pp_split_weighs_the_first_and_last_stages_extra_modules():
    """Stage 0's embedding and vision stack count as 7 decoder layers, the last
    stage's lm_head as 3: their parameter counts, in layers, rounded."""
    job = train_config(GPUS_128)
    model_config = job.model_spec.model
    with torch.device("meta"):
        model = model_config.build()

    def size(*modules) -> int:
        return sum(p.numel() for module in modules for p in module.parameters())

    layer = size(model.layers["0"])
    first = size(model.tok_embeddings, *(getattr(model, f) for f in VISION_MODULE_FQNS))
    parallelism = job.parallelism
    assert parallelism.pipeline_parallel_first_stage_less_layers == round(first / layer)
    assert parallelism.pipeline_parallel_last_stage_less_layers == round(
        size(model.lm_head) / layer
    )
    parts = _generate_llm_fqn_per_model_part(
        *_get_pipeline_metadata(SimpleNamespace(pp=4), parallelism, model_config)
    )
    layers = [sum(fqn.startswith("layers.") for fqn in part) for part in parts]
    assert layers == [9, 16, 15, 12]


def test_asset_and_data_paths_are_overridable():
    job = train_config(
        GPUS_32,
        "--hf_assets_path",
        "/data/Muse-Glimmer-30B",
        "--dataloader.dataset_path",
        "/data/cc12m",
    )
    assert job.hf_assets_path == "/data/Muse-Glimmer-30B"
    assert job.dataloader.dataset_path == "/data/cc12m"


@pytest.mark.parametrize(
    ("name", "overrides", "world_size", "error", "message"),
    [
        (
            GPUS_32,
            ["--training.seq_len", "8000"],
            32,
            ValueError,
            "training.seq_len=8000 must be divisible by lcm(2*tp*cp, 128*cp) = "
            "lcm(16, 512) = 512 with tensor_parallel_degree=2 and "
            "context_parallel_degree=4; nearest valid values: 7680, 8192.",
        ),
        (
            GPUS_32,
            [
                "--parallelism.tensor_parallel_degree",
                "4",
                "--parallelism.data_parallel_shard_degree",
                "2",
            ],
            32,
            ValueError,
            "tensor_parallel_degree (4) must divide every attention head count: "
            "n_heads (32), n_kv_heads (2), vision_encoder.num_heads (16); valid "
            "degrees: [1, 2].",
        ),
        (
            GPUS_32,
            [],
            24,
            AssertionError,
            "Invalid parallel dims: dp_replicate(1) * dp_shard(4) * cp(4) * tp(2) "
            "* pp(1) != WORLD_SIZE(24)",
        ),
        (
            GPUS_128,
            ["--training.seq_len", "262144"],
            128,
            ValueError,
            "Training sequence length 262144 exceeds attention RoPE maximum "
            "supported sequence length 131072.",
        ),
        (
            GPUS_128_SHARDED,
            ["--parallelism.context_parallel_ptrr_mask_key", "swa_128"],
            128,
            ValueError,
            "context_parallel_load_balancer='ptrr' needs "
            "parallelism.context_parallel_ptrr_mask_key to name one of "
            "muse_glimmer's attention masks ['global', 'swa_2048']; got 'swa_128'.",
        ),
    ],
    ids=[
        "seq-len-off-the-cp-grid",
        "tp4-over-2-kv-heads",
        "three-nodes",
        "seq-len-past-rope",
        "ptrr-on-the-debug-mask",
    ],
)
def test_near_miss_fails_at_start_up_naming_the_values(
    name, overrides, world_size, error, message
):
    job = train_config(name, *overrides)
    with pytest.raises(error) as raised:
        _start_up(job, world_size)
    assert str(raised.value) == message


def test_user_split_with_a_part_per_node_instead_of_per_stage_is_rejected():
    job = train_config(GPUS_128)
    layers = [f"layers.{i}" for i in range(52)]
    job.parallelism.module_fqns_per_model_part = [
        ["tok_embeddings", *layers[:17]],
        layers[17:35],
        [*layers[35:], "norm", "lm_head"],
    ]
    with pytest.raises(ValueError) as raised:
        _start_up(job, 128)
    assert str(raised.value) == (
        "parallelism.module_fqns_per_model_part has 3 parts; "
        "pipeline_parallel_schedule='1F1B' runs one stage per rank, so with "
        "pipeline_parallel_degree=4 it needs exactly 4 parts (or choose a "
        "multi-stage schedule such as 'Interleaved1F1B')."
    )


def test_a_vision_mode_typo_in_a_toml_file_is_rejected_naming_the_file(tmp_path):
    text = (TRAIN_CONFIGS / GPUS_32).read_text()
    bad = tmp_path / "typo.toml"
    bad.write_text(text.replace('"replicated"', '"shard"'))
    with pytest.raises(ConfigFileError) as raised:
        train_config(str(bad))
    assert str(raised.value) == (
        f"{bad}: parallelism.context_parallel_vision: expected one of "
        "'replicated', 'sharded', got str 'shard'"
    )
