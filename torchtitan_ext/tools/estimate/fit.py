"""Which job to run: every (CP, TP, PP, AC, vision) on a GPU count, planned and timed.

A candidate keeps the job's model and global batch (rows per step) and spreads
it over ``--gpus`` GPUs: dp_shard makes up the world size, each data rank
trains global batch / dp_shard rows (microbatches of one under PP, 1F1B). Those
the start-up checks refuse are listed with the reason. The rest are timed by
the roofline (``roofline``: an estimate on paper, its assumptions printed and
each a flag), then planned in order of that time (the simulated cluster's
memory per rank, slow) until one fits: that one, the fastest that fits, is
marked. ``--all`` plans every candidate. A job fits when its busiest rank's
planned peak is at most ``--gpu-memory-gb`` x 10^9 bytes: the rest of the
device (an 80 GB H100 has 85.5e9 bytes, a 141 GB H200 150.7e9) is left for
what the planner does not model.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import itertools
import json
from pathlib import Path

from .cli import GIB, MODES, plan_job, table
from .roofline import Hardware, fixed_terms, step_time

__all__ = ["candidates", "choose", "main"]

# The activation checkpointing policies, as tyro's subcommands select them.
AC = {name: f"activation_checkpoint:{name}" for name in ("full", "selective", "none")}


def candidates(job_args: list[str], gpus: int, global_batch: int, space: dict):
    """``(key, config or the reason it is refused)`` for every point of ``space``."""
    from torchtitan.distributed import ParallelDims

    from torchtitan_ext.config_file import load_job
    from torchtitan_ext.muse_glimmer.config_checks import check_job_config

    for cp, tp, pp, ac, vision in itertools.product(*space.values()):
        key = dict(cp=cp, tp=tp, pp=pp, ac=ac, vision=vision)
        if vision == "sharded" and cp == 1:
            continue  # the same job as replicated
        dp = gpus // (cp * tp * pp)
        if cp * tp * pp > gpus:
            yield key, f"cp x tp x pp = {cp * tp * pp} exceeds {gpus} GPUs"
            continue
        if dp * cp * tp * pp != gpus or global_batch % dp:
            yield key, f"{global_batch} rows a step do not split over dp_shard={dp}"
            continue
        if global_batch // dp < pp:
            yield key, f"{global_batch // dp} microbatches cannot fill {pp} stages"
            continue
        degrees = dict(context_parallel=cp, tensor_parallel=tp, pipeline_parallel=pp)
        degrees |= dict(data_parallel_shard=dp)
        args = [f"--parallelism.{k}_degree={d}" for k, d in degrees.items()]
        args += [f"--parallelism.context_parallel_vision={vision}"]
        args += [f"--training.local_batch_size={global_batch // dp}"]
        if pp > 1:
            args += ["--parallelism.pipeline_parallel_schedule=1F1B"]
            args += ["--parallelism.pipeline_parallel_microbatch_size=1"]
        args = [*job_args, *args, AC[ac]]
        try:
            config = load_job(args)
            checked = copy.deepcopy(config)
            check_job_config(checked, gpus)  # the Trainer's start-up checks
            ParallelDims.from_config(checked.parallelism, gpus)
            checked.model_spec.model.update_from_config(config=checked)
        except (ValueError, AssertionError, NotImplementedError) as e:
            yield key, str(e).splitlines()[0]
            continue
        yield key, config


def choose(
    job_args,
    *,
    gpus,
    gpu_memory_gb,
    global_batch,
    images,
    tokens,
    space,
    hardware,
    plan_all=False,
) -> list[dict]:
    """Every candidate's row, fastest first; ``fastest_fitting`` marks the choice."""
    rows, refused = [], []
    for key, config in candidates(job_args, gpus, global_batch, space):
        if isinstance(config, str):
            refused.append({**key, "refused": config})
            continue
        time = step_time(config, gpus, images, tokens, hardware)
        fixed = fixed_terms(config, images, tokens)
        rows.append({**key, "config": config, **dataclasses.asdict(time)})
        rows[-1]["fixed_terms"] = fixed
    # Ties (often at FSDP's bound) go to less work on the critical path.
    rows.sort(key=lambda row: (row["seconds"], row["compute_s"] + row["exposed_s"]))
    chosen = False
    for row in rows:
        config = row.pop("config")
        if chosen and not plan_all:
            continue
        _, _, estimates = plan_job(
            config, images=images, tokens_per_image=tokens, world_size=gpus
        )
        worst = max(estimates, key=lambda e: e.peak)
        row |= {
            "peak_bytes": worst.peak,
            "peak_rank": worst.rank,
            "breakdown": worst.peak_breakdown,
        }
        row["fits"] = worst.peak <= gpu_memory_gb * 1e9
        row["fastest_fitting"] = row["fits"] and not chosen
        chosen = chosen or row["fits"]
    return rows + refused


def _table(rows: list[dict]) -> str:
    columns = ["cp", "tp", "pp", "ac", "vision", "step s (est.)", "compute s"]
    columns += ["TP+CP+PP comm s", "FSDP comm s", "bubble", "peak GiB"]
    columns += ["largest term CP does not shrink, GiB", ""]
    lines = []
    for row in rows:
        if "refused" in row:
            continue
        cells = [str(row[k]) for k in ("cp", "tp", "pp", "ac", "vision")]
        cells += [f"{row[k]:.2f}" for k in ("seconds", "compute_s", "exposed_s")]
        cells += [f"{row['overlapped_s']:.2f}", f"{row['bubble']:.2f}"]
        peak = row.get("peak_bytes")
        cells.append("not planned" if peak is None else f"{peak / GIB:.1f}")
        term, nbytes = max(row["fixed_terms"].items(), key=lambda item: item[1])
        cells.append(f"{term}: {nbytes / GIB:.2f}")
        mark = {True: "fits", False: "too large", None: ""}[row.get("fits")]
        cells.append("**fastest that fits**" if row.get("fastest_fitting") else mark)
        lines.append(cells)
    return table(columns, lines)


def main(argv: list[str] | None = None) -> None:
    from torchtitan_ext.tools.simulated_cluster import job_world_size, parse_job

    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.estimate.fit",
        allow_abbrev=False,
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--config-file", type=Path, help="the job's TOML file (model, data, ...)")
    add("--gpus", type=int, required=True)
    add("--gpu-memory-gb", type=float, required=True, help="10^9 bytes a rank may use")
    add("--seq-len", type=int, help="default: the job's")
    add("--images", type=int, required=True, help="per row (sequence)")
    add("--tokens-per-image", type=int, required=True)
    add("--global-batch", type=int, help="rows per step (default: the job's)")
    add("--cp", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    add("--tp", type=int, nargs="+", default=[1, 2])
    add("--pp", type=int, nargs="+", default=[1, 2, 4])
    add("--ac", nargs="+", choices=list(AC), default=list(AC))
    add("--vision", nargs="+", choices=MODES, default=list(MODES))
    add("--all", action="store_true", help="plan them all, not until one fits")
    add("--json", type=Path)
    assumptions = parser.add_argument_group("roofline assumptions").add_argument
    for field in dataclasses.fields(Hardware):
        flag = "--" + field.name.replace("_", "-")
        assumptions(flag, type=type(field.default), default=field.default)
    own, job_args, job = parse_job(
        parser, argv, config_file="--job.config_file", seq_len="--training.seq_len"
    )
    hardware = Hardware(
        **{f.name: getattr(own, f.name) for f in dataclasses.fields(Hardware)}
    )
    p = job.parallelism
    data_ranks = job_world_size(job) // (
        p.context_parallel_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
    )
    global_batch = own.global_batch or data_ranks * job.training.local_batch_size
    space = dict(cp=own.cp, tp=own.tp, pp=own.pp, ac=own.ac, vision=own.vision)
    rows = choose(
        job_args,
        gpus=own.gpus,
        gpu_memory_gb=own.gpu_memory_gb,
        global_batch=global_batch,
        images=own.images,
        tokens=own.tokens_per_image,
        space=space,
        hardware=hardware,
        plan_all=own.all,
    )
    print(
        f"{job.model_spec.name} {job.model_spec.flavor} on {own.gpus} GPUs of "
        f"{own.gpu_memory_gb:g} GB, seq_len {job.training.seq_len}, {global_batch} "
        f"rows a step, {own.images} images of {own.tokens_per_image} tokens a row\n"
    )
    print(_table(rows))
    refused = collections.Counter(row["refused"] for row in rows if "refused" in row)
    for reason, count in refused.items():
        print(f"refused, {count} candidate(s): {reason}")
    print(
        "\nstep s is an estimate on paper, not a measurement: FLOPs over "
        f"{hardware.peak_tflops:g} TFLOP/s x {hardware.efficiency:g}, collectives "
        f"over {hardware.nvlink_gbps:g} GB/s within a node of "
        f"{hardware.gpus_per_node}, {hardware.network_gbps:g} GB/s across nodes "
        "(torchtitan_ext/tools/estimate/roofline.py says what else it assumes)."
    )
    if own.json is not None:
        own.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"hardware": dataclasses.asdict(hardware), "rows": rows}
        own.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
