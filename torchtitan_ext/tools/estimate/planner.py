"""One training step of one simulated rank under FakeTensorMode, its memory tracked.

The batch is prepared by the plug-in Trainer's own hooks before the fake mode
(the CP mask rewrite and the ptrr balancer read mask values on the host;
``create_block_mask`` compiles). Under PP the rank runs its stage's schedule:
the forwards and backwards of a 1F1B (or GPipe) stage in their order, so the
microbatches it holds at once, the unsharded parameters and the float32
gradients it accumulates between them are all live when they are, not derived.
The steady state repeats itself, so a stage runs its first ``in_flight + 1``
microbatches (``schedule_order``).
"""

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from torchtitan_ext import cpu_backend
from torchtitan_ext.tools.simulated_cluster import simulated_rank

from .host_values import HostValues
from .tracker import FORWARD_DECODER, FORWARD_VISION, region_tracker

__all__ = ["RankEstimate", "estimate_rank", "microbatches_in_flight", "ranks_to_plan"]

# Rows up to this long get the CPU backend's eager block masks (dense, fast to
# build); longer ones torchtitan's compiled create_block_mask.
_EAGER_MASKS_UP_TO = 16384

# MemTracker's reference types (and FSDPMemTracker's), as the planner sums them.
_PARAMETERS = ("Parameter", "Sharded Param")
_BUFFERS = ("Buffer",)
_GRADIENTS = ("Gradient", "Sharded Grad")
_OPTIMIZER = ("Optstate", "OptState")


@dataclass
class RankEstimate:
    """One rank's memory in one training step, in bytes."""

    rank: int
    coordinates: dict[str, int]
    images_encoded: int
    parameters: int  # this rank's parameter shards
    buffers: int  # RoPE tables
    gradients: int  # gradient shards, after the step
    optimizer: int
    decoder_activations: int  # forward peak, decoder region, one microbatch
    vision_activations: int  # forward peak, vision region, one microbatch
    retained_activations: int  # activations alive after one forward
    measured_peak: int  # peak of all tracked bytes over the step (its schedule's)
    peak_breakdown: dict[str, int]  # by MemTracker's kinds, at that peak
    in_flight: int = 1  # microbatches whose activations a stage holds at once
    seconds: float = 0.0

    @property
    def peak(self) -> int:
        """The step's peak; under PP its schedule's, microbatches in flight live."""
        return self.measured_peak


def ranks_to_plan(config, world_size: int, grid_thw_N3: torch.Tensor) -> list[int]:
    """One rank per pipeline stage on dp, cp and tp rank 0 (those ranks hold
    equal bytes); with sharded vision, the first stage also on one CP rank per
    distinct share size of the images."""
    from torchtitan_ext.muse_glimmer import cp_vision_share
    from torchtitan_ext.muse_glimmer.trainer import VisionGeometry

    parallelism = config.parallelism
    cp, pp = parallelism.context_parallel_degree, parallelism.pipeline_parallel_degree
    vision_cp_ranks = [0]
    if parallelism.context_parallel_vision == "sharded" and cp > 1:
        geometry = VisionGeometry.of(config.model_spec.model)
        by_share = {}
        for cp_rank in range(cp):
            start, stop = cp_vision_share(
                grid_thw_N3,
                cp_degree=cp,
                cp_rank=cp_rank,
                spatial_merge_size=geometry.spatial_merge_size,
                vision_dim=geometry.vision_dim,
            ).image_range
            by_share.setdefault(stop - start, cp_rank)
        vision_cp_ranks = sorted(by_share.values())
    # Mesh order pp, dp_replicate, dp_shard, cp, tp: a stage's ranks are contiguous.
    return [
        stage * (world_size // pp) + cp_rank * parallelism.tensor_parallel_degree
        for stage in range(pp)
        for cp_rank in (vision_cp_ranks if stage == 0 else [0])
    ]


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


def schedule_order(microbatches: int, in_flight: int) -> list[tuple[str, int]]:
    """A stage's (``"F"`` or ``"B"``, microbatch) in 1F1B order: ``in_flight``
    forwards, then a backward and a forward each, then the backwards left;
    only the first ``in_flight + 1`` microbatches (GPipe: all forwards first)."""
    count = min(microbatches, in_flight + 1)
    order = [("F", i) for i in range(min(in_flight, count))]
    for i in range(count):
        order.append(("B", i))
        if i + in_flight < count:
            order.append(("F", i + in_flight))
    return order


def _hooks_trainer(simulated):
    """The plug-in's Trainer, unbuilt (no tokenizer, dataloader or checkpointer
    to build it from), holding what ``batch_generator`` and
    ``post_dataloading_process`` read."""
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


def _create_optimizer_state(optimizers) -> None:
    """AdamW's moments, as after a first step: zero gradients and one step."""
    for part in optimizers.model_parts:
        for param in part.parameters():
            param.grad = torch.zeros_like(param)
    optimizers.step()
    optimizers.zero_grad(set_to_none=True)


def _forward(simulated, module, inputs, labels, kwargs, boundary):
    """One microbatch's forward (and loss, on the last stage): the output and
    the stage's input, which a later stage receives from the one before."""
    from torchtitan.components.loss import IGNORE_INDEX

    stage_inputs = []
    if not simulated.has_first_stage:
        shape, dtype = boundary
        inputs = torch.empty(shape, dtype=dtype).requires_grad_()
        stage_inputs = [inputs]
    output = module(inputs, **kwargs)
    if simulated.has_last_stage:  # as Trainer._forward_backward_body
        positions = {k: v for k, v in kwargs.items() if k == "positions"}
        output = simulated.loss_fn(  # over this rank's valid tokens
            output, labels, (labels != IGNORE_INDEX).sum(), **positions
        )[0]
    return output, stage_inputs


def _train_step(
    simulated, train_context, tracker, optimizers, inputs, labels, kwargs, boundary=None
) -> tuple[tuple[int, ...], torch.dtype] | None:
    """``Trainer.train_step``'s body on one batch; under PP, this rank's stage
    in its schedule's order (``schedule_order``), one microbatch being
    ``batch``. A later stage's input has ``boundary``, the (shape, dtype) the
    previous stage returned as sent. Regions are filed for the first forward."""
    import spmd_types as spmd
    from torchtitan.distributed import utils as dist_utils

    (module,) = simulated.model_parts
    schedule = simulated.pp_schedule
    stage = None if schedule is None else schedule._stage
    order = [("F", 0), ("B", 0)]
    if stage is not None:
        in_flight = microbatches_in_flight(schedule, stage.stage_index)
        order = schedule_order(schedule._n_microbatches, in_flight)
    optimizers.zero_grad(set_to_none=simulated.config.training.disable_cuda_graphs)
    alive, sent = {}, None
    with train_context():
        for op, microbatch in order:
            if op == "F":
                first = microbatch == 0
                with tracker.in_forward() if first else contextlib.nullcontext():
                    alive[microbatch] = _forward(
                        simulated, module, inputs, labels, kwargs, boundary
                    )
                if first:
                    tracker.end_forward()
                    sent = tuple(alive[0][0].shape), alive[0][0].dtype
                continue
            output, stage_inputs = alive.pop(microbatch)
            with spmd.no_typecheck():
                if stage is None:
                    output.backward()
                    continue
                # FSDP without gradient sync or resharding, as per microbatch
                output_grads = None
                if not simulated.has_last_stage:
                    output_grads = torch.empty_like(output)
                stage.backward_maybe_with_nosync(
                    "full",
                    {
                        "stage_output": output,
                        "output_grads": output_grads,
                        "input_values": stage_inputs,
                    },
                )
            del output, output_grads, stage_inputs
    if stage is not None:
        stage.perform_reduce_grad(1)
    dist_utils.clip_grad_norm_(
        [p for m in simulated.model_parts for p in m.parameters()],
        simulated.config.training.max_norm,
        foreach=True,
        pp_mesh=simulated.parallel_dims.get_optional_mesh("pp"),
        ep_enabled=simulated.parallel_dims.ep_enabled,
    )
    optimizers.step()
    return None if stage is None else sent


def estimate_rank(config, batch, *, rank: int, world_size=None, boundary=None):
    """Rank ``rank``'s ``RankEstimate`` for one step of ``config`` on one
    microbatch ``batch`` (``synthetic_batch``), and what its PP stage sends
    (``boundary`` of the next stage's estimate)."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS

    start = time.perf_counter()
    with simulated_rank(config, rank=rank, world_size=world_size) as simulated:
        if len(simulated.model_parts) != 1:
            raise NotImplementedError(
                "the planner simulates one model part per rank (1F1B, GPipe); "
                f"this rank holds {len(simulated.model_parts)}"
            )
        (part,) = simulated.model_parts
        train_context = dist_utils.get_spmd_context(
            parallel_dims=simulated.parallel_dims,
            spmd_typechecking=(
                config.parallelism.spmd_backend == "spmd_types"
                and config.debug.spmd_typechecking
            ),
        )
        trainer = _hooks_trainer(simulated)
        input_dict, labels = next(trainer.batch_generator([batch]))
        share = input_dict.get("cp_vision_share")
        images = len(input_dict["grid_thw"])
        if share is not None:
            images = share.image_range[1] - share.image_range[0]
        masks = contextlib.nullcontext()
        if cpu_backend.is_active() and config.training.seq_len > _EAGER_MASKS_UP_TO:
            masks = cpu_backend.compiled_block_masks()
        with masks:
            batch = trainer.post_dataloading_process(input_dict, labels)
        vision = [getattr(part, fqn, None) for fqn in VISION_MODULE_FQNS]
        vision = [module for module in vision if module is not None]
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, HostValues(fake_mode) as host_values:
            batch = host_values.fake(batch)
            part.to_empty(device=torch.device(utils.device_type))  # values unused
            part.train()
            optimizers = simulated.config.optimizer.build(model_parts=[part])
            _create_optimizer_state(optimizers)
            tracker = region_tracker(part, optimizers.optimizers, vision)
            # torchtitan holds every microbatch of a step on the device at once.
            schedule = simulated.pp_schedule
            microbatches = 1 if schedule is None else schedule._n_microbatches
            held = [batch] + [
                tree_map_only(torch.Tensor, torch.empty_like, batch)
                for _ in range(microbatches - 1)
            ]
            tracker.track_batch(held)
            with tracker:
                before = tracker.live_bytes()
                step = (simulated, train_context, tracker, optimizers, *batch)
                sent = _train_step(*step, boundary)
                after = tracker.live_bytes()
        coordinates = simulated.coordinates
        in_flight = 1
        if simulated.pp_schedule is not None:
            in_flight = microbatches_in_flight(simulated.pp_schedule, coordinates["pp"])
        measured_peak, breakdown = tracker.peak_bytes()
    estimate = RankEstimate(
        rank=rank,
        coordinates=coordinates,
        images_encoded=images if vision else 0,
        parameters=sum(before.get(kind, 0) for kind in _PARAMETERS),
        buffers=sum(before.get(kind, 0) for kind in _BUFFERS),
        gradients=sum(after.get(kind, 0) for kind in _GRADIENTS),
        optimizer=sum(before.get(kind, 0) for kind in _OPTIMIZER),
        decoder_activations=tracker.region_peak[FORWARD_DECODER],
        vision_activations=tracker.region_peak[FORWARD_VISION],
        retained_activations=tracker.retained,
        measured_peak=measured_peak,
        peak_breakdown=breakdown,
        in_flight=in_flight,
        seconds=time.perf_counter() - start,
    )
    return estimate, sent
