"""Every TOML job in train_configs/ parses into the plug-in's Trainer config, with
the topology its file name states, and the README lists it."""

import math
import re

import pytest

from torchtitan_ext.config_file import job_ranks
from torchtitan_ext.muse_glimmer.trainer import MuseGlimmerTrainer

from ..jobs import TRAIN_CONFIGS, train_config
from ..training_runs import REPO

NAMES = sorted(p.name for p in TRAIN_CONFIGS.glob("*.toml"))
# File-name word -> the parallelism field its number sets.
_DEGREES = {
    "fsdp": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "pp": "pipeline_parallel_degree",
}


def _stated(name: str) -> tuple[dict[str, int], set[str]]:
    """The degrees and flags a file name states (``tp2_cp2_sp_typechecked``...)."""
    words = name.removesuffix(".toml").split("_")
    degrees, flags = {}, set()
    for word in words:
        match = re.fullmatch(r"(fsdp|cp|tp|pp)(\d+)", word)
        if match:
            degrees[_DEGREES[match[1]]] = int(match[2])
        else:
            flags.add(word)
    return degrees, flags


def test_the_readme_lists_every_job():
    readme = (REPO / "README.md").read_text()
    listed = re.findall(r"^\| `([\w.]+\.toml)` \|", readme, flags=re.M)
    assert sorted(listed) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_train_config_parses_to_the_topology_its_name_states(name):
    config = train_config(name)
    assert isinstance(config, MuseGlimmerTrainer.Config)
    degrees, flags = _stated(name)
    parallelism = config.parallelism
    for field in _DEGREES.values():
        default = -1 if field == "data_parallel_shard_degree" else 1
        assert getattr(parallelism, field) == degrees.get(field, default), field
    if parallelism.tensor_parallel_degree > 1:
        assert parallelism.enable_sequence_parallel == ("sp" in flags)
    assert config.debug.spmd_typechecking == ("typechecked" in flags)
    vision = "sharded" if "sharded" in flags else "replicated"
    assert parallelism.context_parallel_vision == vision
    packed = not flags & {"default", "quickstart", "unpacked"}
    assert (config.dataloader.packing_buffer_size > 0) == packed
    assert job_ranks(config) == math.prod(degrees.values())
    if parallelism.context_parallel_degree > 1:
        config.model_spec.model.update_from_config(config=config)
