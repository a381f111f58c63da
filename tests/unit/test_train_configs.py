"""Every TOML job in train_configs/ parses into the plug-in's Trainer config."""

from pathlib import Path

import pytest
from torchtitan.config import ConfigManager

from torchtitan_ext.config_file import merge_args
from torchtitan_ext.muse_glimmer.trainer import MuseGlimmerTrainer

TRAIN_CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"

# file -> (ranks, packed, cp, tp, dp_shard, pp)
EXPECTED = {
    "default.toml": (1, False, 1, 1, -1, 1),
    "quickstart.toml": (1, False, 1, 1, -1, 1),
    "fsdp2_unpacked.toml": (2, False, 1, 1, 2, 1),
    "tp2_sp_unpacked.toml": (2, False, 1, 2, -1, 1),
    "pp2_unpacked.toml": (2, False, 1, 1, -1, 2),
    "packed.toml": (1, True, 1, 1, -1, 1),
    "cp2.toml": (2, True, 2, 1, -1, 1),
    "cp4.toml": (4, True, 4, 1, -1, 1),
    "fsdp2.toml": (2, True, 1, 1, 2, 1),
    "fsdp2_cp2.toml": (4, True, 2, 1, 2, 1),
    "tp2_sp.toml": (2, True, 1, 2, -1, 1),
    "tp2_cp2_sp.toml": (4, True, 2, 2, -1, 1),
    "pp2.toml": (2, True, 1, 1, -1, 2),
    "fsdp2_pp2.toml": (4, True, 1, 1, 2, 2),
    "cp2_pp2.toml": (4, True, 2, 1, -1, 2),
    "cp2_pp2_interleaved.toml": (4, True, 2, 1, -1, 2),
    "tp2_pp2_sp.toml": (4, True, 1, 2, -1, 2),
    "tp2_cp2_pp2_sp.toml": (8, True, 2, 2, -1, 2),
    # Production jobs of the 30B_mm flavor (tests/unit/test_production_jobs.py).
    "30b_mm_fsdp4_cp4_tp2_sp.toml": (32, True, 4, 2, 4, 1),
    "30b_mm_fsdp4_cp4_tp2_sp_sharded_vision.toml": (32, True, 4, 2, 4, 1),
    "30b_mm_fsdp4_cp4_tp2_pp4_sp.toml": (128, True, 4, 2, 4, 4),
    "30b_mm_fsdp4_cp4_tp2_pp4_sp_sharded_vision.toml": (128, True, 4, 2, 4, 4),
}


def test_every_train_config_is_listed():
    assert sorted(p.name for p in TRAIN_CONFIGS.glob("*.toml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_train_config_parses(name):
    ranks, packed, cp, tp, dp_shard, pp = EXPECTED[name]
    args = merge_args(["--job.config_file", str(TRAIN_CONFIGS / name)])
    config = ConfigManager().parse_args(args)
    assert isinstance(config, MuseGlimmerTrainer.Config)
    parallelism = config.parallelism
    assert parallelism.context_parallel_degree == cp
    assert parallelism.tensor_parallel_degree == tp
    assert parallelism.data_parallel_shard_degree == dp_shard
    assert parallelism.pipeline_parallel_degree == pp
    assert (config.dataloader.packing_buffer_size > 0) == packed
    assert cp * tp * max(dp_shard, 1) * pp == ranks
    if cp > 1:
        config.model_spec.model.update_from_config(config=config)
