"""The smallest CP degree at which a job fits each GPU size, by sequence and images.

Each CP degree keeps the job's world size (dp_shard lowered); at CP1 the two
vision modes coincide, so one plan stands for both. A degree fits a capacity
when the largest per-rank peak is at most that many 10^9 bytes: what the
planner does not model must fit in the difference to the device's size (80 GB
H100: 85.5e9 bytes; 141 GB H200: 150.7e9).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from .cli import GIB, MODES, describe_job, plan_job, table

__all__ = ["main"]


def _plan(job_args, key: dict, tokens_per_image, dp_shard_cp) -> dict:
    """The job at ``key``'s CP degree, with dp_shard making up its world size."""
    from torchtitan_ext.config_file import load_job

    seq_len, images, cp = key["seq_len"], key["images"], key["cp"]
    if dp_shard_cp % cp:
        raise ValueError(
            f"CP{cp} does not divide the job's dp_shard x cp, {dp_shard_cp}"
        )
    config = load_job(
        job_args
        + [
            *("--training.seq_len", str(seq_len)),
            *("--parallelism.context_parallel_degree", str(cp)),
            *("--parallelism.data_parallel_shard_degree", str(dp_shard_cp // cp)),
            *("--parallelism.context_parallel_vision", key["vision"]),
        ]
    )
    size, world_size, estimates = plan_job(
        config, images=images, tokens_per_image=tokens_per_image
    )
    worst = max(estimates, key=lambda e: e.peak)
    return {
        **key,
        "job": describe_job(config, world_size, images, size),
        "world_size": world_size,
        "dp_shard_cp": dp_shard_cp,
        "peak_bytes": worst.peak,
        "peak_rank": worst.rank,
        "derived_bytes": worst.peak - worst.measured_peak,
        "decoder_activation_bytes": worst.decoder_activations,
        "vision_activation_bytes": max(e.vision_activations for e in estimates),
        "state_bytes": sum(
            (worst.parameters, worst.buffers, worst.gradients, worst.optimizer)
        ),
        "ranks_planned": [e.rank for e in estimates],
        "seconds": sum(e.seconds for e in estimates),
    }


def _smallest(plans: list[dict], capacity_gb: float) -> str:
    fitting = [p for p in plans if p["peak_bytes"] <= capacity_gb * 1e9]
    if not fitting:
        return f"> CP{max(p['cp'] for p in plans)}"
    best = min(fitting, key=lambda p: p["cp"])
    return f"CP{best['cp']} ({best['peak_bytes'] / GIB:.1f} GiB)"


def main(argv: list[str] | None = None) -> None:
    from torchtitan_ext.tools.simulated_cluster import job_world_size, parse_job

    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.estimate.fit",
        allow_abbrev=False,
        description=__doc__.split("\n")[0],
    )
    add = parser.add_argument
    add("--config-file", type=Path, help="the job's TOML file")
    add("--seq-len", type=int, nargs="+", required=True)
    add("--images", type=int, nargs="+", required=True)
    add("--cp", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    add("--capacity-gb", type=float, nargs="+", default=[80, 141])
    add("--tokens-per-image", type=int)
    add("--json", type=Path, required=True)
    own, job_args, job = parse_job(parser, argv, config_file="--job.config_file")
    world_size, parallelism = job_world_size(job), job.parallelism
    dp_shard_cp = (
        parallelism.data_parallel_shard_degree * parallelism.context_parallel_degree
    )
    seq_lens, smallest_bytes = sorted(own.seq_len), min(own.capacity_gb) * 1e9
    plans: list[dict] = []
    for seq_len, images, mode in itertools.product(seq_lens, own.images, MODES):
        for cp in sorted(own.cp):
            key = dict(seq_len=seq_len, images=images, cp=cp, vision=mode)
            if cp == 1 and mode == "sharded":
                replicated = {**key, "vision": "replicated"}.items()
                same = next(p for p in plans if replicated <= p.items())
                plan = {**same, "vision": mode, "same_as": "replicated"}
            else:
                plan = _plan(job_args, key, own.tokens_per_image, dp_shard_cp)
            plans.append(plan)
            print(
                f"seq {seq_len}, {images} images, {mode}, CP{cp}: peak "
                f"{plan['peak_bytes'] / GIB:.1f} GiB ({plan.get('seconds', 0):.0f} s)",
                file=sys.stderr,
            )
            own.json.parent.mkdir(parents=True, exist_ok=True)
            own.json.write_text(json.dumps({"plans": plans}, indent=2))
            if plan["peak_bytes"] <= smallest_bytes:
                break
    columns = ["seq_len", "images per row"]
    columns += [f"{mode} vision, {gb:g} GB" for mode in MODES for gb in own.capacity_gb]
    rows = []
    for seq_len, images in itertools.product(seq_lens, own.images):
        cells = [str(seq_len), str(images)]
        for mode in MODES:
            key = dict(seq_len=seq_len, images=images, vision=mode)
            ran = [p for p in plans if key.items() <= p.items()]
            cells += [_smallest(ran, gb) for gb in own.capacity_gb]
        rows.append(cells)
    print(
        f"{own.config_file or ' '.join(job_args)}: {world_size} ranks, "
        f"CP raised with dp_shard x cp = {dp_shard_cp} kept\n"
    )
    print(table(columns, rows))
    print("\nPeak of the largest rank at the smallest fitting CP degree, in GiB.")
    print(f"JSON: {own.json}")


if __name__ == "__main__":
    main()
