"""One rank of a production job, built and parallelized in one process, no GPU.

``python -m torchtitan_ext.tools.simulated_cluster --job.config_file
train_configs/30b_mm_fsdp4_cp4_tp2_sp.toml [--rank R] [--section.key value ...]``
prints rank R's plan: mesh coordinates, pipeline stage(s), modules, FSDP units
and the parameters it holds.

The config, start-up checks, meshes, model and the ModelSpec's ``parallelize_fn``
/ ``pipelining_fn`` are the real ones, called as torchtitan 0.3.0's
``Trainer.__init__`` calls them; the process group is torch's ``fake`` backend
(torchtitan's ``init_fake_mode``), so one process stands for any rank of any
world size, and parameters stay on the meta device. torchtitan's own ``--comm.mode
fake_backend`` would run the whole Trainer (materialized parameters, tokenizer,
dataloader, a step: GiBs and hours for a 30B_mm rank on a CPU). A process has
one default process group: ``simulated_rank`` owns it for its ``with`` block."""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan_ext import config_file

if TYPE_CHECKING:  # torchtitan is imported after cpu_backend.apply(), in functions.
    from torch import nn
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torchtitan.components.loss import BaseLoss
    from torchtitan.distributed import ParallelDims
    from torchtitan.trainer import Trainer

__all__ = [
    "SimulatedRank",
    "describe",
    "job_world_size",
    "main",
    "parse_job",
    "simulated_rank",
]


@dataclass
class SimulatedRank:
    """What torchtitan's Trainer holds on one rank once the model is parallelized."""

    rank: int
    config: Trainer.Config  # a copy of the job's, its model config updated
    parallel_dims: ParallelDims  # meshes built
    model_parts: list[nn.Module]  # this rank's, parallelized, on the meta device
    loss_fn: BaseLoss  # bound to the last stage's lm_head when chunked
    pp_schedule: _PipelineSchedule | None = None
    has_first_stage: bool = True
    has_last_stage: bool = True

    @property
    def coordinates(self) -> dict[str, int]:
        meshes = self.parallel_dims.get_all_one_dimensional_meshes()
        return {name: mesh.get_local_rank() for name, mesh in meshes.items()}


def job_world_size(config) -> int:
    """``config_file.job_ranks``, with ``data_parallel_shard_degree`` explicit:
    with -1 the job fits any multiple of the other degrees."""
    if (degree := config.parallelism.data_parallel_shard_degree) < 1:
        raise ValueError(
            f"data_parallel_shard_degree={degree} leaves the world size to the "
            "launcher; pass world_size (--world-size) to simulate the job."
        )
    return config_file.job_ranks(config)


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """DTensor's sharding cache compares meshes by value: a job simulated again gets
    DTensors on the previous run's destroyed meshes, which FSDP refuses, so the cache
    is cleared on entry and exit (torch refuses a second default process group)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torchtitan.distributed.utils import init_fake_mode

    _clear_sharding_prop_cache()
    init_fake_mode(world_size, rank=rank)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


@contextlib.contextmanager
def spmd_backend(name: str):
    """torchtitan's process-wide SPMD backend, set as the Trainer does and restored."""
    from torchtitan.distributed import utils as dist_utils

    previous = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(name)
    try:
        yield
    finally:
        dist_utils.set_spmd_backend(previous)


@contextlib.contextmanager
def simulated_rank(
    config, *, rank: int = 0, world_size: int | None = None
) -> Iterator[SimulatedRank]:
    """Rank ``rank`` of ``config`` (copied) on a fake world, for the ``with`` block."""
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.config.override import apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.tools import utils

    from torchtitan_ext.muse_glimmer.config_checks import check_job_config
    from torchtitan_ext.muse_glimmer.trainer import MuseGlimmerTrainer

    config = copy.deepcopy(config)
    world_size = job_world_size(config) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if isinstance(config, MuseGlimmerTrainer.Config):
        # MuseGlimmerTrainer.init_distributed: before any process group.
        check_job_config(config, world_size)
    spec = config.model_spec
    with (
        _fake_process_group(rank, world_size),
        spmd_backend(config.parallelism.spmd_backend),
    ):
        # Trainer.__init__, in its order, from init_distributed to the model parts.
        parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
        parallel_dims.build_mesh()
        spec.model.update_from_config(config=config)
        if config.override.imports:
            apply_overrides(config.override, config)
        with (
            torch.device("meta"),
            utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]),
        ):
            model = spec.model.build()
        model.verify_module_protocol()
        loss_fn = config.loss.build(compile_config=config.compile)
        kwargs = dict(
            parallel_dims=parallel_dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint,
            dump_folder=config.dump_folder,
        )
        if parallel_dims.pp_enabled:
            schedule, parts, has_first, has_last = spec.pipelining_fn(
                model,
                **kwargs,
                # The Trainer passes its local device; the stages' buffers and
                # p2p shapes are made on it in the first step, never here.
                device=torch.device(utils.device_type),
                model_config=spec.model,
                parallelize_fn=spec.parallelize_fn,
                loss_fn=loss_fn,
            )
        else:
            schedule, has_first, has_last = None, True, True
            parts = [spec.parallelize_fn(model, **kwargs)]
        if isinstance(loss_fn, ChunkedLossWrapper) and has_last:
            # The Trainer's: the chunked loss applies lm_head, the model skips it.
            loss_fn.set_lm_head(parts[-1].lm_head)
            parts[-1]._skip_lm_head = True
        yield SimulatedRank(
            rank, config, parallel_dims, parts, loss_fn, schedule, has_first, has_last
        )


def describe(simulated: SimulatedRank) -> str:
    """A few lines on what the rank holds: coordinates, stages, FSDP units, sizes."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    coordinates = ", ".join(f"{n} {i}" for n, i in simulated.coordinates.items())
    world_size = simulated.parallel_dims.world_size
    lines = [f"rank {simulated.rank} of {world_size}: {coordinates or 'alone'}"]
    for index, part in enumerate(simulated.model_parts):
        children = [name for name, child in part.named_children() if child is not None]
        units = sum(isinstance(module, FSDPModule) for module in part.modules())
        params = list(part.parameters())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        lines.append(
            f"model part {index}: {', '.join(children)}; {units} FSDP units; "
            f"{sum(p.numel() for p in local) / 1e9:.3f}B of its "
            f"{sum(p.numel() for p in params) / 1e9:.3f}B parameters held here, "
            f"on {', '.join(sorted({str(p.device) for p in local}))}"
        )
    return "\n".join(lines)


def parse_job(parser, argv: list[str] | None, **job_flags: str):
    """The tools' command lines: ``parser``'s own arguments, the job's arguments and
    the job. ``job_flags`` maps an own argument to the job flag it stands for (those
    set go first, then the rest: the job's overrides). torchtitan runs on the CPU
    backend; a job that does not load is a usage error, as a bad flag is."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    own, overrides = parser.parse_known_args(argv)
    job_args = []
    for name, flag in job_flags.items():
        value = getattr(own, name)
        job_args += [] if value is None else [flag, str(value)]
    job_args += overrides
    try:
        return own, job_args, config_file.load_job(job_args)
    except config_file.ConfigFileError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.simulated_cluster",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, help="default: the job's degrees")
    own, _, config = parse_job(parser, argv)
    with simulated_rank(config, rank=own.rank, world_size=own.world_size) as rank:
        print(describe(rank))


if __name__ == "__main__":
    main()
