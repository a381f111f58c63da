"""``python -m torchtitan_ext.tools.estimate``: a job's memory per rank, as a table."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

__all__ = ["GIB", "main", "plan_job"]

GIB = 2**30
MIB = 2**20

_COLUMNS = (
    "rank",
    "pp",
    "cp",
    "images here",
    "params {unit}",
    "buffers {unit}",
    "grads {unit}",
    "optimizer {unit}",
    "decoder act. {unit}",
    "vision act. {unit}",
    "retained / mb {unit}",
    "in flight",
    "measured peak {unit}",
    "peak {unit}",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.estimate",
        allow_abbrev=False,
        description="Memory per rank of one training step of a job, measured "
        "under FakeTensorMode on a fake process group (see the package's "
        "docstring). Other arguments are the job's: --module M --config C "
        "instead of --config-file, --section.key overrides.",
    )
    parser.add_argument("--config-file", type=Path, help="the job's TOML file")
    parser.add_argument("--seq-len", type=int, help="training.seq_len")
    parser.add_argument(
        "--images", type=int, default=1, help="images per row (sequence)"
    )
    parser.add_argument(
        "--tokens-per-image",
        type=int,
        help="placeholders per image, a square (default: the encoder's native "
        "grid, shrunk until the images fill at most half of a row)",
    )
    parser.add_argument(
        "--vision",
        choices=("replicated", "sharded"),
        help="parallelism.context_parallel_vision",
    )
    parser.add_argument(
        "--world-size", type=int, help="needed when dp_shard is -1 in the job"
    )
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        help="global ranks to simulate (default: one per pipeline stage; every "
        "CP rank with sharded vision)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser


def job_arguments(own: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The job's command line: its file, then the planner's own overrides."""
    args = []
    if own.config_file is not None:
        args += ["--job.config_file", str(own.config_file)]
    if own.seq_len is not None:
        args += ["--training.seq_len", str(own.seq_len)]
    if own.vision is not None:
        args += ["--parallelism.context_parallel_vision", own.vision]
    return args + overrides


def plan_job(
    config,
    *,
    images: int,
    tokens_per_image: int | None = None,
    world_size: int | None = None,
    ranks: list[int] | None = None,
    log=None,
):
    """The image size, world size and every planned rank's ``RankEstimate`` for
    ``config`` on rows of ``images`` images, stage by stage."""
    from torchtitan_ext.tools.simulated_cluster import job_world_size

    from .batch import image_size, synthetic_batch
    from .planner import estimate_rank, ranks_to_plan

    world_size = world_size or job_world_size(config)
    training, parallelism = config.training, config.parallelism
    size = image_size(
        config.model_spec.model.vision_encoder,
        seq_len=training.seq_len,
        images=images,
        tokens_per_image=tokens_per_image,
    )
    batch = synthetic_batch(
        config.model_spec.model,
        rows=(
            parallelism.pipeline_parallel_microbatch_size
            if parallelism.pipeline_parallel_degree > 1
            else training.local_batch_size
        ),
        seq_len=training.seq_len,
        images=images,
        size=size,
    )
    ranks = ranks or ranks_to_plan(config, world_size, batch[0]["grid_thw"])
    estimates, boundary = [], None
    for rank in ranks:
        estimate, sent = estimate_rank(
            config, batch, rank=rank, world_size=world_size, boundary=boundary
        )
        boundary = sent or boundary
        estimates.append(estimate)
        if log is not None:
            log(f"rank {rank}: {estimate.seconds:.0f} s")
    return size, world_size, estimates


def _cells(estimate, unit: int) -> list[str]:
    c = estimate.coordinates
    return [
        str(estimate.rank),
        str(c.get("pp", 0)),
        str(c.get("cp", 0)),
        str(estimate.images_encoded),
        *(
            f"{value / unit:.2f}"
            for value in (
                estimate.parameters,
                estimate.buffers,
                estimate.gradients,
                estimate.optimizer,
                estimate.decoder_activations,
                estimate.vision_activations,
                estimate.retained_activations,
            )
        ),
        str(estimate.in_flight),
        f"{estimate.measured_peak / unit:.2f}",
        f"{estimate.peak / unit:.2f}",
    ]


def table(columns, rows) -> str:
    """A markdown table, right-aligned."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " ---: |" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe_job(config, world_size: int, images: int, size) -> str:
    p = config.parallelism
    others = (
        ("pp", p.pipeline_parallel_degree),
        ("dp_replicate", p.data_parallel_replicate_degree),
        ("cp", p.context_parallel_degree),
        ("tp", p.tensor_parallel_degree),
    )
    dp_shard = world_size // math.prod(degree for _, degree in others)
    degrees = ", ".join(
        f"{name} {degree}"
        for name, degree in (*others[:2], ("dp_shard", dp_shard), *others[2:])
        if degree != 1
    )
    ac = type(config.activation_checkpoint).__qualname__.split(".")[0]
    ac = "none" if config.activation_checkpoint is None else ac
    return (
        f"{config.model_spec.name} {config.model_spec.flavor}, {world_size} ranks "
        f"({degrees or 'one rank'}), seq_len {config.training.seq_len}, "
        f"{images} image(s) of {size} per row, vision "
        f"{p.context_parallel_vision}, activation checkpointing {ac}, "
        f"params {config.training.mixed_precision_param} for compute"
    )


_NOTES = """\
Measured under FakeTensorMode (torch.distributed._tools' FSDPMemTracker, or
MemTracker without FSDP): tensor bytes of one step on each rank (zero_grad,
forward, backward, clip, optimizer step), nothing allocated. params: this
rank's parameter shards; buffers: its RoPE tables; grads: gradient shards
after the step; optimizer: AdamW state; decoder / vision act.: peak bytes the
forward allocates, by module region, for one microbatch (the loss's forward
included; FSDP's all-gathers not; flex attention as a fused kernel: outputs
and log-sum-exp only, no score matrices); measured peak: the peak of all
tracked bytes (parameters, unsharded parameters, gradients, optimizer state,
activations, backward temporaries, collective buffers).
peak = measured peak + (in flight - 1) x retained / mb: under PP a stage
holds "in flight" microbatches' activations at once; only one is measured,
the others are this product (derived, not measured). Not modelled: the CUDA
context, NCCL/communication workspaces, the caching allocator's rounding and
fragmentation."""


def report(config, world_size, images, size, estimates) -> str:
    worst = max(estimates, key=lambda e: e.peak)
    unit, name = (GIB, "GiB") if worst.peak >= GIB else (MIB, "MiB")
    lines = [describe_job(config, world_size, images, size), ""]
    columns = [column.format(unit=name) for column in _COLUMNS]
    lines.append(table(columns, [_cells(e, unit) for e in estimates]))
    breakdown = ", ".join(
        f"{kind} {nbytes / unit:.2f}"
        for kind, nbytes in worst.peak_breakdown.items()
        if nbytes >= unit / 100
    )
    lines += [
        "",
        f"Largest peak: rank {worst.rank}, {worst.peak / unit:.2f} {name}; at "
        f"its measured peak ({name}): {breakdown}.",
        "",
        _NOTES,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()

    from torchtitan_ext.config_file import ConfigFileError
    from torchtitan_ext.tools.simulated_cluster import load_job

    parser = _parser()
    own, overrides = parser.parse_known_args(argv)
    try:
        config = load_job(job_arguments(own, overrides))
    except ConfigFileError as e:
        parser.error(str(e))
    start = time.perf_counter()
    size, world_size, estimates = plan_job(
        config,
        images=own.images,
        tokens_per_image=own.tokens_per_image,
        world_size=own.world_size,
        ranks=own.ranks,
        log=lambda line: print(line, file=sys.stderr),
    )
    print(report(config, world_size, own.images, size, estimates))
    print(
        f"\n{len(estimates)} rank(s) simulated in {time.perf_counter() - start:.0f} s"
    )
    if own.json is not None:
        rows = [{**asdict(e), "peak": e.peak, "stage": e.stage} for e in estimates]
        own.json.parent.mkdir(parents=True, exist_ok=True)
        job = describe_job(config, world_size, own.images, size)
        own.json.write_text(json.dumps({"job": job, "rows": rows}, indent=2))
