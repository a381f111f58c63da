"""``python -m torchtitan_ext.tools.estimate``: a job's memory per rank, as a table."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

__all__ = ["GIB", "main", "plan_job"]

GIB = 2**30
MIB = 2**20
MODES = ("replicated", "sharded")  # parallelism.context_parallel_vision

_COLUMNS = (
    *("rank", "pp", "cp", "images here", "params {unit}", "buffers {unit}"),
    *("grads {unit}", "optimizer {unit}", "decoder act. {unit}"),
    *("vision act. {unit}", "retained / mb {unit}", "in flight"),
    "peak {unit}",
)

_NOTES = """\
Tensor bytes of one step per rank (zero_grad, forward, backward, clip,
optimizer step) under FakeTensorMode and torch's (FSDP)MemTracker. decoder /
vision act.: the forward's peak by module region, one microbatch (FSDP's
all-gathers not included; flex attention as a fused kernel: no score matrices).
Under PP each stage runs its schedule's forwards and backwards in order, holding
"in flight" microbatches at once (and every microbatch's inputs); retained /
mb: what one forward leaves alive. Checked against measured peaks:
benchmarks/planner_peak.py. Not modelled: the CUDA context, NCCL workspaces,
the allocator's rounding and fragmentation."""


def plan_job(
    config, *, images: int, tokens_per_image=None, world_size=None, ranks=None
):
    """The image size, world size and each planned rank's ``RankEstimate`` for
    ``config`` on rows of ``images`` images, stage by stage."""
    from torchtitan_ext.tools.simulated_cluster import job_world_size

    from .batch import image_size, synthetic_batch
    from .planner import estimate_rank, ranks_to_plan

    world_size = world_size or job_world_size(config)
    training, parallelism = config.training, config.parallelism
    seq_len, model = training.seq_len, config.model_spec.model
    size = image_size(
        model.vision_encoder,
        seq_len=seq_len,
        images=images,
        tokens_per_image=tokens_per_image,
    )
    rows = training.local_batch_size
    if parallelism.pipeline_parallel_degree > 1:
        rows = parallelism.pipeline_parallel_microbatch_size
    batch = synthetic_batch(model, rows=rows, seq_len=seq_len, images=images, size=size)
    estimates, boundary = [], None
    for rank in ranks or ranks_to_plan(config, world_size, batch[0]["grid_thw"]):
        estimate, sent = estimate_rank(
            config, batch, rank=rank, world_size=world_size, boundary=boundary
        )
        boundary = sent or boundary
        estimates.append(estimate)
        print(f"rank {rank}: {estimate.seconds:.0f} s", file=sys.stderr)
    return size, world_size, estimates


def table(columns, rows) -> str:
    """A markdown table, right-aligned."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " ---: |" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe_job(config, world_size: int, images: int, size) -> str:
    p = config.parallelism
    degrees = {"pp": p.pipeline_parallel_degree}
    degrees |= {"dp_replicate": p.data_parallel_replicate_degree, "dp_shard": 1}
    degrees |= {"cp": p.context_parallel_degree, "tp": p.tensor_parallel_degree}
    degrees["dp_shard"] = world_size // math.prod(degrees.values())
    degrees = ", ".join(f"{name} {d}" for name, d in degrees.items() if d != 1)
    ac = config.activation_checkpoint
    ac = "none" if ac is None else type(ac).__qualname__.split(".")[0]
    return (
        f"{config.model_spec.name} {config.model_spec.flavor}, {world_size} ranks "
        f"({degrees or 'one rank'}), seq_len {config.training.seq_len}, "
        f"{images} image(s) of {size} per row, vision "
        f"{p.context_parallel_vision}, activation checkpointing {ac}, "
        f"params {config.training.mixed_precision_param} for compute"
    )


def _report(job: str, estimates) -> str:
    worst = max(estimates, key=lambda e: e.peak)
    unit, name = (GIB, "GiB") if worst.peak >= GIB else (MIB, "MiB")
    rows = []
    for e in estimates:
        sizes = (e.parameters, e.buffers, e.gradients, e.optimizer)
        sizes += (e.decoder_activations, e.vision_activations, e.retained_activations)
        where = (e.rank, e.coordinates.get("pp", 0), e.coordinates.get("cp", 0))
        rows.append(
            [*map(str, (*where, e.images_encoded))]
            + [f"{value / unit:.2f}" for value in sizes]
            + [
                str(e.in_flight),
                f"{e.peak / unit:.2f}",
            ]
        )
    breakdown = ", ".join(
        f"{kind} {nbytes / unit:.2f}"
        for kind, nbytes in worst.peak_breakdown.items()
        if nbytes >= unit / 100
    )
    return (
        f"{job}\n\n{table([c.format(unit=name) for c in _COLUMNS], rows)}\n\n"
        f"Largest peak: rank {worst.rank}, {worst.peak / unit:.2f} {name}; at "
        f"its peak ({name}): {breakdown}.\n\n{_NOTES}"
    )


def main(argv: list[str] | None = None) -> None:
    from torchtitan_ext.tools.simulated_cluster import parse_job

    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.estimate",
        allow_abbrev=False,
        description="Memory per rank of one training step of a job under "
        "FakeTensorMode on a fake process group. Other arguments are the job's: "
        "--module M --config C instead of --config-file, --section.key overrides.",
    )
    add = parser.add_argument
    add("--config-file", type=Path, help="the job's TOML file")
    add("--seq-len", type=int, help="training.seq_len")
    add("--images", type=int, default=1, help="images per row (sequence)")
    add("--tokens-per-image", type=int, help="a square (default: native, fitting)")
    add("--vision", choices=MODES, help="parallelism.context_parallel_vision")
    add("--world-size", type=int, help="needed when dp_shard is -1 in the job")
    add("--ranks", type=int, nargs="+", help="default: one per stage, vision share")
    add("--json", type=Path, help="also write the rows here")
    own, _, config = parse_job(
        parser,
        argv,
        config_file="--job.config_file",
        seq_len="--training.seq_len",
        vision="--parallelism.context_parallel_vision",
    )
    size, world_size, estimates = plan_job(
        config,
        images=own.images,
        tokens_per_image=own.tokens_per_image,
        world_size=own.world_size,
        ranks=own.ranks,
    )
    job = describe_job(config, world_size, own.images, size)
    print(_report(job, estimates))
    seconds = sum(e.seconds for e in estimates)
    print(f"\n{len(estimates)} rank(s) simulated in {seconds:.0f} s")
    if own.json is not None:
        rows = [
            {**asdict(e), "peak": e.peak, "stage": e.coordinates.get("pp")}
            for e in estimates
        ]
        own.json.parent.mkdir(parents=True, exist_ok=True)
        own.json.write_text(json.dumps({"job": job, "rows": rows}, indent=2))
