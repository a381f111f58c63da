"""Preprocessing overhead: the plug-in's bank indices against one CP training step.

The plug-in adds to ``post_dataloading_process`` the bank indices built from
the unsharded tokens (and stacked with them through the one ``cp_shard``), and
to ``batch_generator`` a placeholder check on the CPU batch. On the real
Trainer of a CP job (default ``train_configs/cp2.toml``, 2 ranks) each measured
step times on its batch torchtitan's and the plug-in's post-processing in
alternated pairs on fresh copies (added: their difference per pair, in wall
and process CPU time, which leaves out time other processes held the cores),
the index build and the check alone, and ``train_step``. Medians over steps,
and the quartiles of all pairs' added time. Extra arguments are torchtitan
flags::

    python benchmarks/preprocessing_overhead.py
    python benchmarks/preprocessing_overhead.py --seq-len 256 --steps 2 --pairs 3
"""

import os
import statistics
import sys

import _harness  # benchmarks/, first on sys.path when run as a script


def _measure_step(trainer, cpu_batch, pairs: int) -> dict:
    from torchtitan.trainer import Trainer

    from torchtitan_ext.muse_glimmer import (
        build_vision_bank_indices,
        check_vision_placeholders,
    )

    batch = _harness.to_device(trainer, cpu_batch)
    input_dict, cpu_dict = batch[0], cpu_batch[0]
    if input_dict.get("grid_thw") is None:
        raise ValueError("a batch without images; the benchmark needs multimodal data")
    image_id = input_dict["special_tokens"]["image_id"]
    merge = trainer.model_config.vision_encoder.downsample_factor

    def on_images(fn, tokens_dict=input_dict):
        tokens, grid_thw = tokens_dict["input"], tokens_dict["grid_thw"]
        return fn(tokens, grid_thw, image_id=image_id, spatial_merge_size=merge)

    def post(fn, *first):  # wall and CPU ms of fn on a fresh copy of the batch
        return lambda: _harness.timed_ms(
            trainer, fn, *first, *_harness.clone_batch(batch)
        )

    sides = {
        "upstream": post(Trainer.post_dataloading_process, trainer),
        "plugin": post(trainer.post_dataloading_process),
    }
    times = _harness.in_pairs(sides, pairs)
    up, plug = times["upstream"], times["plugin"]
    added, added_cpu = (
        [p[i] - u[i] for u, p in zip(up, plug, strict=True)] for i in (0, 1)
    )
    index_ms = [
        _harness.timed_ms(trainer, on_images, build_vision_bank_indices)[0]
        for _ in range(pairs)
    ]
    check_ms, _ = _harness.timed_ms(
        trainer, on_images, check_vision_placeholders, cpu_dict
    )
    return {
        "images": len(cpu_dict["grid_thw"]),
        "image_tokens": int((cpu_dict["input"] == image_id).sum()),
        "upstream_post_ms": statistics.median(ms for ms, _ in up),
        "plugin_post_ms": statistics.median(ms for ms, _ in plug),
        "added_ms": statistics.median(added),
        "added_ms_pairs": added,
        "added_cpu_ms": statistics.median(added_cpu),
        "added_cpu_ms_pairs": added_cpu,
        "index_ms": statistics.median(index_ms),
        "check_ms": check_ms,
        "step_ms": _harness.train_step(trainer, batch),
    }


_MEDIANS = ("upstream_post_ms", "plugin_post_ms", "added_ms", "added_cpu_ms")
_MEDIANS += ("index_ms", "check_ms", "step_ms")


def _measure(args, trainer) -> dict:
    """This rank's steps and their medians."""
    import torch

    batches = trainer.batch_generator(trainer.dataloader)
    steps = [
        _measure_step(trainer, next(batches), args.pairs)
        for _ in range(args.warmup + args.steps)
    ]
    steps = steps[args.warmup :]
    median = {key: statistics.median(step[key] for step in steps) for key in _MEDIANS}
    step_ms = median["step_ms"]
    return {
        "rank": torch.distributed.get_rank(),
        **median,
        "added_pct_of_step": 100 * median["added_ms"] / step_ms,
        "added_with_check_pct_of_step": (
            100 * (median["added_ms"] + median["check_ms"]) / step_ms
        ),
        "added_cpu_pct_of_step": 100 * median["added_cpu_ms"] / step_ms,
        "index_pct_of_step": 100 * median["index_ms"] / step_ms,
        **{
            f"{key}_quartiles_all_pairs": statistics.quantiles(
                [pair for step in steps for pair in step[f"{key}_pairs"]], n=4
            )
            for key in ("added_ms", "added_cpu_ms")
        },
        "steps": steps,
    }


_COLUMNS = [
    ("rank", "{rank}"),
    ("upstream post ms", "{upstream_post_ms:.2f}"),
    ("plug-in post ms", "{plugin_post_ms:.2f}"),
    ("added ms", "{added_ms:.2f}"),
    ("added CPU ms", "{added_cpu_ms:.2f}"),
    ("index build ms", "{index_ms:.2f}"),
    ("check ms", "{check_ms:.2f}"),
    ("step ms", "{step_ms:.1f}"),
    ("added %", "{added_pct_of_step:.3f}%"),
    ("added CPU %", "{added_cpu_pct_of_step:.3f}%"),
    ("added + check %", "{added_with_check_pct_of_step:.3f}%"),
    ("index %", "{index_pct_of_step:.4f}%"),
]


def _report(args, job: dict, ranks: list[dict]) -> tuple[str, dict]:
    load = job["load_average"]
    lines = [
        f"median over {args.steps} steps (post-processing: median of {args.pairs} "
        f"alternated pairs per step); images per batch "
        f"{[s['images'] for s in ranks[0]['steps']]}; 1-min load average "
        f"{load['start'][0]:.1f} at start, {load['end'][0]:.1f} at end on "
        f"{os.cpu_count()} cores",
        _harness.row_table(_COLUMNS, ranks),
    ]
    for s in ranks:
        wall, cpu = (
            " / ".join(f"{q:.2f}" for q in s[f"{key}_quartiles_all_pairs"])
            for key in ("added_ms", "added_cpu_ms")
        )
        lines.append(
            f"rank {s['rank']}: added ms over all {args.steps * args.pairs} pairs, "
            f"quartiles: wall {wall}, CPU {cpu}"
        )
    return "\n".join(lines), {"cpu_count": os.cpu_count(), "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    parser = _harness.job_parser(__doc__, "preprocessing_overhead.json", steps=5)
    parser.add_argument(
        "--pairs", type=_harness.at_least(2), default=7, help="post-processing pairs"
    )
    return _harness.run_job(parser, argv, _measure, _report)


if __name__ == "__main__":
    sys.exit(main())
