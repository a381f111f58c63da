"""One training step of one simulated rank under FakeTensorMode, its memory tracked.

``estimate_rank`` builds the rank (``simulated_cluster.simulated_rank``: the
job's real model, parallelize and pipelining functions on the fake process
group), prepares the synthetic batch with the plug-in Trainer's own hooks
(``batch_generator``: the placeholder check and, with sharded vision, this CP
rank's share of the images; ``post_dataloading_process``: bank indices, flex
masks, the CP load balancer's sharding, spmd types), then, under
``FakeTensorMode`` with ``HostValues``, materializes the parameters
(``to_empty``, as the Trainer does; ``init_weights`` is skipped, values do not
matter), builds the job's optimizer and its state, and runs one step inside a
``RegionTracker``:

- without PP, ``Trainer.train_step``'s body: ``zero_grad``, the model and loss
  forward and ``loss.backward()`` in the Trainer's SPMD context, torchtitan's
  ``clip_grad_norm_``, ``optimizers.step()``;
- under PP, what the schedule does on this rank for one microbatch: the stage
  module's forward (the embedding stage on the batch, a later stage on a
  received activation of the stage boundary's shape, the last stage also the
  loss), ``PipelineStage.backward_maybe_with_nosync`` (FSDP without gradient
  sync or resharding, as for every microbatch), ``perform_reduce_grad``, then
  the clip and optimizer step. A single-stage schedule holds ``in_flight``
  microbatches' activations at once (1F1B: ``min(pp - stage, microbatches)``;
  GPipe: all); the planner measures one and adds ``in_flight - 1`` times the
  activations one microbatch leaves alive after its forward: the only
  derived figure, reported as such.

The batch is prepared before the fake mode, as ``memory_per_rank`` prepares it
before its tracker (the CP mask rewrite and the ptrr balancer read mask
values on the host; ``create_block_mask`` compiles).
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtitan_ext.tools.simulated_cluster import simulated_rank

from .host_values import HostValues
from .tracker import FORWARD_DECODER, FORWARD_VISION, region_tracker

__all__ = [
    "RankEstimate",
    "StageBoundary",
    "estimate_rank",
    "microbatches_in_flight",
    "ranks_to_plan",
]

# MemTracker's reference types (and FSDPMemTracker's), as the planner sums them.
_PARAMETERS = ("Parameter", "Sharded Param")
_BUFFERS = ("Buffer",)
_GRADIENTS = ("Gradient", "Sharded Grad")
_OPTIMIZER = ("Optstate", "OptState")


@dataclass(frozen=True)
class StageBoundary:
    """Shape and dtype of the activation a pipeline stage sends to the next."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class RankEstimate:
    """One rank's memory in one training step, in bytes (see ``planner``)."""

    rank: int
    coordinates: dict[str, int]
    images_encoded: int
    parameters: int  # this rank's parameter shards
    buffers: int  # this rank's buffers (RoPE tables)
    gradients: int  # this rank's gradient shards, after the step
    optimizer: int  # optimizer state
    decoder_activations: int  # forward peak, decoder region, one microbatch
    vision_activations: int  # forward peak, vision region, one microbatch
    retained_activations: int  # activations alive after one forward
    measured_peak: int  # peak of all tracked bytes over the step
    peak_breakdown: dict[str, int]  # by MemTracker's kinds, at that peak
    in_flight: int = 1  # microbatches whose activations a stage holds at once
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def stage(self) -> int | None:
        return self.coordinates.get("pp")

    @property
    def peak(self) -> int:
        """The step's peak: measured, plus ``in_flight - 1`` more microbatches'
        retained activations under PP (derived)."""
        return self.measured_peak + (self.in_flight - 1) * self.retained_activations


def ranks_to_plan(config, world_size: int, grid_thw_N3: torch.Tensor) -> list[int]:
    """Global ranks worth simulating for a batch of images ``grid_thw_N3``.

    One per pipeline stage, on dp 0 and tp 0 (DP and TP ranks hold equal
    bytes), on CP rank 0 (CP ranks hold equal shares of the decoder); with
    sharded vision, the first stage also on one CP rank per distinct share
    size of the images (``cp_vision_share``, as the Trainer splits them).
    """
    from torchtitan_ext.muse_glimmer import cp_vision_share
    from torchtitan_ext.muse_glimmer.trainer import VisionGeometry

    parallelism = config.parallelism
    degrees = {
        "pp": parallelism.pipeline_parallel_degree,
        "dp_replicate": parallelism.data_parallel_replicate_degree,
        "dp_shard": 1,
        "cp": parallelism.context_parallel_degree,
        "tp": parallelism.tensor_parallel_degree,
    }
    degrees["dp_shard"] = world_size // math.prod(degrees.values())
    vision_cp_ranks = [0]
    geometry = VisionGeometry.of(config.model_spec.model)
    if parallelism.context_parallel_vision == "sharded" and degrees["cp"] > 1:
        by_share = {}
        for cp_rank in range(degrees["cp"]):
            start, stop = cp_vision_share(
                grid_thw_N3,
                cp_degree=degrees["cp"],
                cp_rank=cp_rank,
                spatial_merge_size=geometry.spatial_merge_size,
                vision_dim=geometry.vision_dim,
            ).image_range
            by_share.setdefault(stop - start, cp_rank)
        vision_cp_ranks = sorted(by_share.values())
    ranks = []
    for stage in range(degrees["pp"]):
        for cp_rank in vision_cp_ranks if stage == 0 else [0]:
            coordinate = {"pp": stage, "dp_replicate": 0, "dp_shard": 0}
            coordinate.update(cp=cp_rank, tp=0)
            rank = 0
            for name, degree in degrees.items():
                rank = rank * degree + coordinate[name]
            ranks.append(rank)
    return ranks


def microbatches_in_flight(schedule, stage_index: int) -> int:
    """Microbatches whose activations a stage holds at its first backward."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    microbatches = schedule._n_microbatches
    if isinstance(schedule, Schedule1F1B):
        return min(schedule._num_stages - stage_index, microbatches)
    if isinstance(schedule, ScheduleGPipe):
        return microbatches
    raise NotImplementedError(
        f"the planner models single-stage schedules (1F1B, GPipe), not "
        f"{type(schedule).__name__}"
    )


def _hooks_trainer(simulated):
    """The plug-in's Trainer, unbuilt, holding what its batch hooks read.

    ``simulated_cluster`` builds no tokenizer, dataloader or checkpointer, so
    ``MuseGlimmerTrainer.__init__`` cannot run; ``batch_generator`` and
    ``post_dataloading_process`` need only the rank's config, model, meshes
    and device (and a metrics counter), given here.
    """
    from torchtitan.tools import utils

    from torchtitan_ext.muse_glimmer.trainer import MuseGlimmerTrainer

    if not isinstance(simulated.config, MuseGlimmerTrainer.Config):
        raise TypeError(
            f"the planner runs the plug-in's jobs; got {type(simulated.config)}"
        )
    trainer = MuseGlimmerTrainer.__new__(MuseGlimmerTrainer)
    trainer.config = simulated.config
    trainer.model_config = simulated.config.model_spec.model
    trainer.model_parts = simulated.model_parts
    trainer.parallel_dims = simulated.parallel_dims
    trainer.device = torch.device(utils.device_type)
    trainer.ntokens_seen = 0
    trainer.metrics_processor = types.SimpleNamespace(
        ntokens_since_last_log=0, data_loading_times=[]
    )
    return trainer


def _prepared_batch(simulated, batch) -> tuple[Any, ...]:
    """The batch as the model gets it on this rank, and the images it encodes."""
    trainer = _hooks_trainer(simulated)
    input_dict, labels = next(trainer.batch_generator([batch]))
    share = input_dict.get("cp_vision_share")
    images = len(input_dict["grid_thw"])
    if share is not None:
        images = share.image_range[1] - share.image_range[0]
    inputs, labels, kwargs = trainer.post_dataloading_process(input_dict, labels)
    return inputs, labels, kwargs, images


def _sum(live: dict[str, int], kinds: tuple[str, ...]) -> int:
    return sum(live.get(kind, 0) for kind in kinds)


def _create_optimizer_state(optimizers) -> None:
    """AdamW's moments, as after a first step: zero gradients and one step."""
    for part in optimizers.model_parts:
        for param in part.parameters():
            param.grad = torch.zeros_like(param)
    optimizers.step()
    optimizers.zero_grad(set_to_none=True)


def _clip_and_step(simulated, optimizers) -> None:
    from torchtitan.distributed import utils as dist_utils

    parallel_dims = simulated.parallel_dims
    dist_utils.clip_grad_norm_(
        [p for m in simulated.model_parts for p in m.parameters()],
        simulated.config.training.max_norm,
        foreach=True,
        pp_mesh=parallel_dims.get_optional_mesh("pp"),
        ep_enabled=parallel_dims.ep_enabled,
    )
    optimizers.step()


def _loss(simulated, pred, labels, kwargs):
    """The job's loss, as ``Trainer._forward_backward_body`` calls it."""
    from torchtitan.components.loss import IGNORE_INDEX

    global_valid_tokens = (labels != IGNORE_INDEX).sum()  # this rank's count
    loss_kwargs = {"positions": kwargs["positions"]} if "positions" in kwargs else {}
    loss, _ = simulated.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
    return loss


def _train_step(
    simulated, train_context, tracker, optimizers, inputs, labels, kwargs
) -> None:
    """``Trainer.train_step`` without PP, one batch."""
    import spmd_types as spmd

    (model,) = simulated.model_parts
    optimizers.zero_grad(set_to_none=simulated.config.training.disable_cuda_graphs)
    with train_context():
        with tracker.in_forward():
            loss = _loss(simulated, model(inputs, **kwargs), labels, kwargs)
        tracker.end_forward()
        with spmd.no_typecheck():
            loss.backward()
    _clip_and_step(simulated, optimizers)


def _pipeline_step(
    simulated, train_context, tracker, optimizers, inputs, labels, kwargs, boundary
) -> StageBoundary:
    """What a single-stage schedule runs on this rank for one microbatch."""
    import spmd_types as spmd

    (stage_module,) = simulated.model_parts
    stage = simulated.pp_schedule._stage
    optimizers.zero_grad(set_to_none=simulated.config.training.disable_cuda_graphs)
    with train_context():
        with tracker.in_forward():
            if simulated.has_first_stage:
                stage_inputs = []
                output = stage_module(inputs, **kwargs)
            else:
                received = torch.empty(boundary.shape, dtype=boundary.dtype)
                stage_inputs = [received.requires_grad_()]
                output = stage_module(received, **kwargs)
            if simulated.has_last_stage:
                output = _loss(simulated, output, labels, kwargs)
        sent = StageBoundary(tuple(output.shape), output.dtype)
        tracker.end_forward()
        output_grads = None
        if not simulated.has_last_stage:
            output_grads = torch.empty_like(output)
        with spmd.no_typecheck():
            stage.backward_maybe_with_nosync(
                "full",
                {
                    "stage_output": output,
                    "output_grads": output_grads,
                    "input_values": stage_inputs,
                },
            )
    del output, output_grads, stage_inputs
    stage.perform_reduce_grad(1)
    _clip_and_step(simulated, optimizers)
    return sent


def _vision_modules(model_part) -> list:
    from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS

    modules = (getattr(model_part, fqn, None) for fqn in VISION_MODULE_FQNS)
    return [module for module in modules if module is not None]


def _tracked_step(simulated, train_context, batch, boundary):
    """One step of the rank's model part under FakeTensorMode and a region
    tracker: (tracker, live bytes before and after, what a PP stage sends)."""
    from torchtitan.tools import utils

    (part,) = simulated.model_parts
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode, HostValues(fake_mode) as host_values:
        inputs, labels, kwargs = host_values.fake(batch)
        part.to_empty(device=torch.device(utils.device_type))
        part.train()
        optimizers = simulated.config.optimizer.build(model_parts=[part])
        _create_optimizer_state(optimizers)
        tracker = region_tracker(part, optimizers.optimizers, _vision_modules(part))
        tracker.track_batch((inputs, labels, kwargs))
        try:
            with tracker:
                before = tracker.live_bytes()
                step_args = (simulated, train_context, tracker, optimizers)
                step_args += (inputs, labels, kwargs)
                if simulated.pp_schedule is not None:
                    sent = _pipeline_step(*step_args, boundary)
                else:
                    _train_step(*step_args)
                    sent = None
                after = tracker.live_bytes()
        finally:
            tracker.remove_hooks()
    return tracker, before, after, sent


def estimate_rank(
    config,
    batch,
    *,
    rank: int,
    world_size: int | None = None,
    boundary: StageBoundary | None = None,
) -> tuple[RankEstimate, StageBoundary | None]:
    """Rank ``rank``'s memory in one step of ``config`` (a plug-in job) on
    ``batch``, one microbatch as the dataloader yields it (``synthetic_batch``).

    Under PP a stage after the first needs ``boundary``, what the previous
    stage sends (returned by the previous stage's estimate), and every stage
    returns its own.
    """
    from torchtitan.distributed import utils as dist_utils

    from torchtitan_ext.tools.simulated_cluster import _coordinates

    start = time.perf_counter()
    parallelism = config.parallelism
    pp = parallelism.pipeline_parallel_degree > 1
    with simulated_rank(config, rank=rank, world_size=world_size) as simulated:
        if len(simulated.model_parts) != 1:
            raise NotImplementedError(
                "the planner simulates one model part per rank (1F1B, GPipe); "
                f"this rank holds {len(simulated.model_parts)}"
            )
        train_context = dist_utils.get_spmd_context(
            parallel_dims=simulated.parallel_dims,
            spmd_typechecking=(
                parallelism.spmd_backend == "spmd_types"
                and config.debug.spmd_typechecking
            ),
        )
        coordinates = _coordinates(simulated.parallel_dims)
        inputs, labels, kwargs, images_here = _prepared_batch(simulated, batch)
        (part,) = simulated.model_parts
        tracker, before, after, sent = _tracked_step(
            simulated, train_context, (inputs, labels, kwargs), boundary
        )
        measured_peak, breakdown = tracker.peak_bytes()
        in_flight = (
            microbatches_in_flight(simulated.pp_schedule, coordinates["pp"])
            if pp
            else 1
        )
    estimate = RankEstimate(
        rank=rank,
        coordinates=coordinates,
        images_encoded=images_here if _vision_modules(part) else 0,
        parameters=_sum(before, _PARAMETERS),
        buffers=_sum(before, _BUFFERS),
        gradients=_sum(after, _GRADIENTS),
        optimizer=_sum(before, _OPTIMIZER),
        decoder_activations=tracker.region_peak[FORWARD_DECODER],
        vision_activations=tracker.region_peak[FORWARD_VISION],
        retained_activations=tracker.retained,
        measured_peak=measured_peak,
        peak_breakdown=breakdown,
        in_flight=in_flight,
        seconds=time.perf_counter() - start,
    )
    return estimate, sent
