"""Every production job, built and parallelized on a simulated cluster of its size.

For each job (``train_configs/30b_mm_*.toml``) rank 0, and under PP also the
last rank (the last stage), is built from the real model code on the meta
device and parallelized by the plug-in's functions on a fake process group of
the job's world size (``torchtitan_ext.tools.simulated_cluster``). Its plan is
compared with upstream's for the same model, world, TP and PP: torchtitan's own
model, parallelize and pipelining functions, with CP folded into dp_shard
(upstream refuses CP for the vision encoder). FSDP then shards over the same
ranks, dp_shard x cp, so every parameter must be sharded exactly alike. The
long-context jobs (seq_len up to 131072) are also built with the other vision
mode and selective activation checkpointing, one job per world size.

Checked on each rank:
- nothing real is allocated: every parameter and buffer is on the meta
  device, and the peak RSS grows by less than 256 MiB (the 32-rank job's
  fp32 parameter shard alone would be 3.7 GB);
- every vision parameter is ``R`` on cp and FSDP shards it over a mesh
  dimension that spans this rank's CP group;
- the TP plan covers upstream's: every module upstream annotates carries the
  same layouts on every mesh axis but cp;
- the FSDP units are upstream's, and every parameter has upstream's global
  shape, placements and rank grid;
- under PP, the stage split is upstream's, and the vision modules sit on the
  first stage with ``tok_embeddings`` (none on the last);
- the vision activations are ``R`` on cp, or ``V`` with sharded vision.
"""

import copy
import dataclasses

import pytest
import spmd_types as spmd
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.models.muse_glimmer import model_registry as upstream_model_registry
from torchtitan.protocols.sharding import LocalMapConfig, ShardingConfig, SpmdLayout
from torchtitan.tools import utils

from torchtitan_ext import cpu_backend
from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS
from torchtitan_ext.muse_glimmer.config_registry import MAX_SEQ_LEN_30B
from torchtitan_ext.muse_glimmer.sharding import CP
from torchtitan_ext.tools import simulated_cluster
from torchtitan_ext.tools.simulated_cluster import job_world_size, simulated_rank

from ..jobs import PRODUCTION_CONFIGS, TRAIN_CONFIGS, train_config

_RSS_GROWTH_LIMIT = 256 * 2**20


def _upstream_reference(job):
    """``job`` as torchtitan would run it: its model and functions, cp folded into
    dp_shard (the same FSDP ranks)."""
    reference = copy.deepcopy(job)
    reference.model_spec = upstream_model_registry(
        job.model_spec.flavor, attn_backend="flex"
    )
    # Upstream's flavor stops at 16384 tokens, the released model at 131072.
    for layer in reference.model_spec.model.layers:
        rope = dataclasses.replace(layer.attention.rope, max_seq_len=MAX_SEQ_LEN_30B)
        layer.attention.rope = rope
    parallelism = reference.parallelism
    parallelism.data_parallel_shard_degree *= parallelism.context_parallel_degree
    parallelism.context_parallel_degree = 1
    parallelism.context_parallel_vision = "replicated"  # upstream has no such mode
    return reference


def _without_cp(value):
    """A sharding config as comparable values, its cp axis dropped."""
    if isinstance(value, SpmdLayout):
        axis_types = {str(k): repr(v) for k, v in value.axis_types.items() if k != CP}
        return axis_types, repr(value.partition_spec)
    if isinstance(value, dict):
        return {key: _without_cp(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_without_cp(item) for item in value]
    if isinstance(value, ShardingConfig | LocalMapConfig):
        return {
            field.name: _without_cp(getattr(value, field.name))
            for field in dataclasses.fields(value)
        }
    return value


def _plan(simulated) -> list[dict]:
    """What must match upstream's, per model part."""
    return [
        {
            "modules": [
                name for name, child in part.named_children() if child is not None
            ],
            "layers": list(part.layers) if part.layers is not None else None,
            "fsdp_units": sorted(
                name
                for name, module in part.named_modules()
                if isinstance(module, FSDPModule)
            ),
            "parameters": {
                name: (
                    tuple(param.shape),
                    tuple(param.placements),
                    param.device_mesh.mesh.tolist(),
                )
                for name, param in part.named_parameters()
            },
            "tp_plan": {
                name: _without_cp(module._sharding_config)
                for name, module in part.named_modules()
                if getattr(module, "_sharding_config", None) is not None
            },
        }
        for part in simulated.model_parts
    ]


def _ranks_along(param: DTensor, mesh_dim: int) -> set[int]:
    """The ranks this rank shares ``param``'s mesh dimension ``mesh_dim`` with."""
    mesh = param.device_mesh
    index = list(mesh.get_coordinate())
    index[mesh_dim] = slice(None)
    return set(mesh.mesh[tuple(index)].tolist())


def _sharded(placement) -> bool:
    # FSDP over TP-sharded dim 0 is a _StridedShard, which is no Shard.
    return not (placement.is_replicate() or placement.is_partial())


def _check_nothing_real(simulated) -> None:
    for part in simulated.model_parts:
        for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            assert local.is_meta, f"{name} is on {local.device}"


def _check_vision_on_cp(simulated, module) -> None:
    """Vision parameters ``R`` on cp, FSDP-sharded over a dim spanning the CP group."""
    cp_group = set(simulated.parallel_dims.get_mesh("cp").mesh.tolist())
    for name, child in module.named_modules():
        config = getattr(child, "_sharding_config", None)
        for param_name, layout in (config.state_shardings if config else {}).items():
            assert layout.axis_types.get(CP) is spmd.R, (name, param_name, layout)
    for name, param in module.named_parameters():
        assert isinstance(param, DTensor), name
        assert any(
            _sharded(placement) and cp_group <= _ranks_along(param, dim)
            for dim, placement in enumerate(param.placements)
        ), (name, param.placements, param.device_mesh)


def _vision_activation_cp_types(module) -> set:
    types = set()
    for _, child in module.named_modules():
        config = getattr(child, "_sharding_config", None)
        if config is None:
            continue
        for layouts in (config.in_dst_shardings, config.out_src_shardings):
            if isinstance(layouts, SpmdLayout):
                layouts = {"output": layouts}
            for layout in (layouts or {}).values():
                if layout is not None and layout.partition_spec is None:
                    types.add(layout.axis_types.get(CP))
    return types


def _ranks_to_simulate(job) -> list[int]:
    world_size = job_world_size(job)
    return [0, world_size - 1] if job.parallelism.pipeline_parallel_degree > 1 else [0]


@pytest.fixture(scope="module")
def upstream_plans() -> dict:
    """Upstream's plans by reference job and rank: the vision modes share one."""
    return {}


def _upstream_plan(upstream_plans: dict, job, rank: int) -> list[dict]:
    reference = _upstream_reference(job)
    # seq_len shapes no parameter: the long-context jobs of one world share it.
    training = dataclasses.replace(reference.training, seq_len=0)
    key = (repr(reference.parallelism), repr(training), rank)
    key += (repr(reference.activation_checkpoint),)
    if key not in upstream_plans:
        with simulated_rank(reference, rank=rank) as simulated:
            upstream_plans[key] = _plan(simulated)
    return upstream_plans[key]


def _check_stage(simulated, *, sharded: bool) -> None:
    """The vision modules on the first stage only, with ``tok_embeddings``, on cp."""
    pp = simulated.parallel_dims.pp
    pp_rank = simulated.parallel_dims.get_mesh("pp").get_local_rank() if pp > 1 else 0
    assert simulated.has_first_stage == (pp_rank == 0)
    assert simulated.has_last_stage == (pp_rank == pp - 1)
    part = simulated.model_parts[0]
    if not simulated.has_first_stage:
        for fqn in (*VISION_MODULE_FQNS, "tok_embeddings"):
            assert getattr(part, fqn) is None, fqn
        return
    for fqn in (*VISION_MODULE_FQNS, "tok_embeddings"):
        assert getattr(part, fqn) is not None, fqn
    vision = [getattr(part, fqn) for fqn in VISION_MODULE_FQNS]
    for module in vision:
        _check_vision_on_cp(simulated, module)
    cp_types = set().union(*map(_vision_activation_cp_types, vision))
    assert cp_types == ({spmd.R, spmd.V} if sharded else {spmd.R}), cp_types


# The long-context jobs' other vision mode and AC policy, on each world size.
LONG_CONTEXT_64 = "30b_mm_128k_fsdp4_cp8_tp2_sp.toml"
LONG_CONTEXT_128 = "30b_mm_32k_fsdp4_cp16_tp2_sp.toml"
VARIANTS = [
    (name, *overrides)
    for name in (LONG_CONTEXT_64, LONG_CONTEXT_128)
    for overrides in (
        ("--parallelism.context_parallel_vision", "sharded"),
        ("activation_checkpoint:selective",),
    )
]


@pytest.mark.parametrize(
    "job_args", [(n,) for n in PRODUCTION_CONFIGS] + VARIANTS, ids=" ".join
)
def test_production_job_plan_on_its_simulated_cluster(job_args, upstream_plans):
    job = train_config(*job_args)
    sharded = job.parallelism.context_parallel_vision == "sharded"
    for rank in _ranks_to_simulate(job):
        if cpu_backend.is_active():
            utils.device_module.reset_peak_memory_stats()  # peak RSS := current
        rss_before = cpu_backend.peak_rss_bytes()
        with simulated_rank(job, rank=rank) as simulated:
            rss_growth = cpu_backend.peak_rss_bytes() - rss_before
            _check_nothing_real(simulated)
            _check_stage(simulated, sharded=sharded)
            plan = _plan(simulated)
        if cpu_backend.is_active():
            assert rss_growth < _RSS_GROWTH_LIMIT, rss_growth
        upstream = _upstream_plan(upstream_plans, job, rank)
        for key in ("modules", "layers", "fsdp_units", "parameters", "tp_plan"):
            assert [part[key] for part in plan] == [part[key] for part in upstream], key


def test_cli_prints_a_ranks_plan(capsys):
    # A debug job leaves dp_shard to the launcher: the world size is given.
    simulated_cluster.main(
        [
            "--job.config_file",
            str(TRAIN_CONFIGS / "tp2_cp2_pp2_sp.toml"),
            "--world-size",
            "8",
            "--rank",
            "7",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rank 7 of 8: pp 1, loss 1, cp 1, tp 1"
    assert lines[1].startswith("model part 0: layers, norm, lm_head; ")
    assert lines[1].endswith(" parameters held here, on meta")


def test_a_job_without_its_world_size_is_refused():
    with pytest.raises(ValueError) as raised:
        job_world_size(train_config("tp2_cp2_pp2_sp.toml"))
    assert str(raised.value) == (
        "data_parallel_shard_degree=-1 leaves the world size to the launcher; "
        "pass world_size (--world-size) to simulate the job."
    )
