"""Preprocessing overhead: the plug-in's bank indices against one CP training step.

The plug-in adds to torchtitan's ``post_dataloading_process`` building
``vision_bank_indices`` from the unsharded tokens, stacking them with the
tokens so the one upstream ``cp_shard`` call permutes both, and unbinding them
again; and to ``batch_generator`` a placeholder check on the CPU batch. On the
real ``MuseGlimmerTrainer`` of a CP job (default ``train_configs/cp2.toml``,
seq_len 2048, 2 ranks), every measured step takes one batch and times, on it:

- upstream: ``Trainer.post_dataloading_process`` (masks + ``cp_shard`` + types;
  on CPU with eager block masks throughout, as ``cpu_backend`` sets them);
- plug-in: ``MuseGlimmerTrainer.post_dataloading_process`` (the same, plus the
  bank indices), alternating with upstream pair after pair, on fresh copies;
- added: plug-in minus upstream, per pair, in wall time and in process CPU
  time (which leaves out time other processes held the cores);
- index build: ``build_vision_bank_indices`` alone, on the same tokens;
- check: ``check_vision_placeholders`` on the CPU batch (no upstream part);
- step: ``Trainer.train_step`` on the same batch (post-processing, forward,
  backward, gradient clipping, optimizer, metrics).

Medians over steps (each step's value the median over its pairs), and the
quartiles of all pairs' added time: on a busy CPU host the added time is the
difference of two noisy timings, the index build a direct one. Started as
a plain script it runs itself on ``--nproc`` local ranks; extra arguments are
torchtitan flags and win over the job file::

    python benchmarks/preprocessing_overhead.py
    python benchmarks/preprocessing_overhead.py --seq-len 256 --steps 2 --pairs 3
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import _harness  # benchmarks/, first on sys.path when run as a script


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _harness.add_job_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--pairs", type=int, default=7, help="post-processing pairs")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("outputs/benchmarks/preprocessing_overhead.json"),
    )
    args, extra = parser.parse_known_args(argv)
    if args.pairs < 2 or args.steps < 1:
        parser.error(
            f"--pairs must be >= 2 and --steps >= 1, got {args.pairs} and {args.steps}"
        )
    return args, extra


def _timed_ms(trainer, fn, *fn_args) -> tuple[float, float]:
    """Wall time and process CPU time of ``fn(*fn_args)``, in ms.

    CPU time leaves out the time other processes held the cores: on a shared
    CPU host it is the steadier measure of work added.
    """
    _harness.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*fn_args)
    _harness.synchronize(trainer)
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def _measure_step(trainer, batch, cpu_batch, pairs: int) -> dict:
    from torchtitan.trainer import Trainer

    from torchtitan_ext.muse_glimmer import (
        build_vision_bank_indices,
        check_vision_placeholders,
    )

    input_dict, _ = batch
    if input_dict.get("grid_thw") is None:
        raise ValueError("a batch without images; the benchmark needs multimodal data")
    image_id = input_dict["special_tokens"]["image_id"]
    merge = trainer.model_config.vision_encoder.downsample_factor

    def on_images(fn, tokens_dict=input_dict):
        return fn(
            tokens_dict["input"],
            tokens_dict["grid_thw"],
            image_id=image_id,
            spatial_merge_size=merge,
        )

    upstream = lambda b: Trainer.post_dataloading_process(trainer, *b)  # noqa: E731
    plugin = lambda b: trainer.post_dataloading_process(*b)  # noqa: E731
    upstream_ms, plugin_ms, added_ms, added_cpu_ms, index_ms = [], [], [], [], []
    for pair in range(pairs):
        copies = [_harness.clone_batch(batch) for _ in range(2)]
        first, second = (upstream, plugin) if pair % 2 == 0 else (plugin, upstream)
        times = {
            first: _timed_ms(trainer, first, copies[0]),
            second: _timed_ms(trainer, second, copies[1]),
        }
        upstream_ms.append(times[upstream][0])
        plugin_ms.append(times[plugin][0])
        added_ms.append(times[plugin][0] - times[upstream][0])
        added_cpu_ms.append(times[plugin][1] - times[upstream][1])
        index_ms.append(_timed_ms(trainer, on_images, build_vision_bank_indices)[0])
    cpu_dict, _ = cpu_batch
    check_ms, _ = _timed_ms(trainer, on_images, check_vision_placeholders, cpu_dict)
    return {
        "images": len(cpu_dict["grid_thw"]),
        "image_tokens": int((cpu_dict["input"] == image_id).sum()),
        "upstream_post_ms": statistics.median(upstream_ms),
        "plugin_post_ms": statistics.median(plugin_ms),
        "added_ms": statistics.median(added_ms),
        "added_ms_pairs": added_ms,
        "added_cpu_ms": statistics.median(added_cpu_ms),
        "added_cpu_ms_pairs": added_cpu_ms,
        "index_ms": statistics.median(index_ms),
        "check_ms": check_ms,
        "step_ms": _harness.train_step(trainer, batch),
    }


_MEDIANS = ("upstream_post_ms", "plugin_post_ms", "added_ms", "added_cpu_ms")
_MEDIANS += ("index_ms", "check_ms", "step_ms")


def _summary(rank: int, steps: list[dict]) -> dict:
    median = {key: statistics.median(step[key] for step in steps) for key in _MEDIANS}
    return {
        "rank": rank,
        **median,
        "added_pct_of_step": 100 * median["added_ms"] / median["step_ms"],
        "added_with_check_pct_of_step": (
            100 * (median["added_ms"] + median["check_ms"]) / median["step_ms"]
        ),
        "added_cpu_pct_of_step": 100 * median["added_cpu_ms"] / median["step_ms"],
        "index_pct_of_step": 100 * median["index_ms"] / median["step_ms"],
        "added_ms_quartiles_all_pairs": statistics.quantiles(
            [pair for step in steps for pair in step["added_ms_pairs"]], n=4
        ),
        "added_cpu_ms_quartiles_all_pairs": statistics.quantiles(
            [pair for step in steps for pair in step["added_cpu_ms_pairs"]], n=4
        ),
        "steps": steps,
    }


def _table(summaries: list[dict]) -> str:
    lines = [
        "| rank | upstream post ms | plug-in post ms | added ms | added CPU ms | "
        "index build ms | check ms | step ms | added % | added CPU % | "
        "added + check % | index % |",
        "| ---: " * 12 + "|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['rank']} | {s['upstream_post_ms']:.2f} | "
            f"{s['plugin_post_ms']:.2f} | {s['added_ms']:.2f} | "
            f"{s['added_cpu_ms']:.2f} | {s['index_ms']:.2f} | {s['check_ms']:.2f} | "
            f"{s['step_ms']:.1f} | {s['added_pct_of_step']:.3f}% | "
            f"{s['added_cpu_pct_of_step']:.3f}% | "
            f"{s['added_with_check_pct_of_step']:.3f}% | "
            f"{s['index_pct_of_step']:.4f}% |"
        )
    return "\n".join(lines)


def _worker(args: argparse.Namespace, extra: list[str]) -> tuple[dict, dict]:
    """This rank's summary, and the job it ran (with the host's load)."""
    import torch

    load_at_start = os.getloadavg()
    trainer = _harness.build_job_trainer(
        args, extra, args.steps, "preprocessing_overhead_run"
    )
    try:
        batches = trainer.batch_generator(trainer.dataloader)
        steps = []
        for step in range(args.warmup + args.steps):
            cpu_batch = next(batches)
            batch = _harness.to_device(trainer, cpu_batch)
            row = _measure_step(trainer, batch, cpu_batch, args.pairs)
            if step >= args.warmup:
                steps.append(row)
        load = {"start": load_at_start, "end": os.getloadavg()}
        job = _harness.job_summary(trainer) | {"load_average": load}
        return _summary(torch.distributed.get_rank(), steps), job
    finally:
        trainer.close()


def _report(args, extra, job: dict, summaries: list[dict]) -> None:
    load = job["load_average"]
    print(
        f"\n{args.config_file}: cp {job['cp']}, seq_len {job['seq_len']}, "
        f"local batch {job['local_batch_size']}, {job['load_balancer']} balancer, "
        f"{job['device']}; median over {args.steps} steps "
        f"(post-processing: median of {args.pairs} alternated pairs per step); "
        f"images per batch {[s['images'] for s in summaries[0]['steps']]}; "
        f"1-min load average {load['start'][0]:.1f} at start, {load['end'][0]:.1f} "
        f"at end on {os.cpu_count()} cores"
    )
    print(_table(summaries))
    for s in summaries:
        wall = " / ".join(f"{q:.2f}" for q in s["added_ms_quartiles_all_pairs"])
        cpu = " / ".join(f"{q:.2f}" for q in s["added_cpu_ms_quartiles_all_pairs"])
        print(
            f"rank {s['rank']}: added ms over all {args.steps * args.pairs} pairs, "
            f"quartiles: wall {wall}, CPU {cpu}"
        )
    _harness.write_json(
        args.json,
        {
            "args": vars(args) | {"torchtitan_args": extra},
            **job,
            "cpu_count": os.cpu_count(),
            "ranks": summaries,
        },
    )


def main(argv: list[str] | None = None) -> int:
    return _harness.run_job(_parse(argv), _worker, _report)


if __name__ == "__main__":
    sys.exit(main())
