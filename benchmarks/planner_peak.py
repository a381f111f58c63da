"""The memory planner's peak per rank against the measured one, on real ranks.

Each job runs on its ranks (gloo): one warm-up step, then one step watched by
``_live_memory.LiveMemory`` (every storage an op creates or FSDP resizes, until
it dies). The measured peak is the highest live total without attention
scratch, plus what was alive when the step began (parameter shards, buffers,
optimizer state, the prepared batch): the eager CPU flex kernel's [B, H, Lq,
Lk] scores, which a fused GPU kernel never stores, are the one thing left out;
FSDP's unsharded parameters and a pipeline stage's microbatches in flight count.
The same job is then planned (``torchtitan_ext.tools.estimate.plan_job``) and
each planned rank set beside its measured twin.

    python benchmarks/planner_peak.py                    # every job, table + JSON
    python benchmarks/planner_peak.py --jobs cp2_fp32 --seq-len 1024
"""

import argparse
import gc
import time

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _harness import MIB

# Name: (TOML, ranks, torchtitan flags). The debug model's packed job in fp32,
# in bf16 with full AC under TP2+SP, and under PP (1F1B, 4 microbatches: stage
# 0 holds 2 at once, on top of its accumulated float32 gradients).
JOBS = {
    "cp2_fp32": ("cp2.toml", 2, ["--training.mixed_precision_param", "float32"]),
    "tp2_cp2_sp_bf16_full_ac": (
        "tp2_cp2_sp.toml",
        4,
        ["--training.mixed_precision_param", "bfloat16", "activation_checkpoint:full"],
    ),
    "cp2_pp2_1f1b_fp32": (
        "cp2_pp2.toml",
        4,
        [
            *("--training.mixed_precision_param", "float32"),
            *("--parallelism.pipeline_parallel_schedule", "1F1B"),
            *("--parallelism.pipeline_parallel_microbatch_size", "1"),
            *("--training.local_batch_size", "4"),
        ],
    ),
}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = _harness.row_parser(
        __doc__, seq_len=512, images=[8], tokens=16, json="planner_peak.json"
    )
    add = parser.add_argument
    add("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS))
    add("--layers", type=int, default=4, help="decoder layers (0: all)")
    args = _harness.parse_row(parser, argv)
    if len(args.images) != 1:
        parser.error(f"--images takes one count here; got {args.images}")
    return args


def _job(args, name: str, dump: str) -> list[str]:
    toml, _, flags = JOBS[name]
    return [
        *("--job.config_file", str(_harness.REPO / "train_configs" / toml)),
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", "1"),
        *("--dump_folder", dump),
        *flags,
    ]


def _measure(args, trainer) -> dict:
    """This rank's measured peak over one step after a warm-up step."""
    from _live_memory import LiveMemory, storage_bytes

    # torchtitan fetches each of a step's microbatches from the data iterator.
    microbatches = getattr(trainer, "num_pipeline_parallel_microbatches", 1)
    rows = trainer.config.training.local_batch_size // microbatches
    batch = _harness.synthetic_batch(
        trainer.model_config, args.seq_len, args.images[0], args.tokens_per_image, rows
    )
    for _ in ("warm-up", "measured"):
        trainer.optimizers.zero_grad(set_to_none=True)
        gc.collect()
        tensors = [[*m.parameters(), *m.buffers()] for m in trainer.model_parts]
        states = [o.state for o in trainer.optimizers.optimizers]
        alive = storage_bytes([tensors, states])
        trainer.step += 1
        with LiveMemory() as live:
            batches = [_harness.clone_batch(batch) for _ in range(microbatches)]
            trainer.train_step(trainer.batch_generator(batches))
    return {
        "rank": torch.distributed.get_rank(),
        "alive_bytes": alive,
        "peak_bytes": alive + live.peak_fused,
    }


def measure(args, name: str) -> dict[int, dict]:
    """Each rank's measured figures for job ``name``, by rank."""
    import tempfile

    with tempfile.TemporaryDirectory() as dump:
        job = _job(args, name, dump)
        ranks = JOBS[name][1]
        measured = _harness._on_ranks(
            ranks, _measure, args, job, layers=args.layers, one_batch=False
        )
    return {rank["rank"]: rank for rank, _ in measured}


def plan(args, name: str):
    """The planner's ``RankEstimate`` of each rank it plans for job ``name``."""
    from torchtitan_ext.tools.estimate.cli import plan_job

    config = _harness.load_config(_job(args, name, "unused"), args.layers)
    _, _, estimates = plan_job(
        config,
        images=args.images[0],
        tokens_per_image=args.tokens_per_image,
        world_size=JOBS[name][1],
    )
    return estimates


def compare(name: str, estimates, measured: dict[int, dict]) -> list[dict]:
    return [
        {
            "job": name,
            "rank": e.rank,
            "stage": e.coordinates.get("pp", 0),
            "in_flight": e.in_flight,
            "planned_mib": e.peak / MIB,
            "measured_mib": measured[e.rank]["peak_bytes"] / MIB,
            "error": e.peak / measured[e.rank]["peak_bytes"] - 1,
        }
        for e in estimates
    ]


_COLUMNS = [
    *(("job", "{job}"), ("rank", "{rank}"), ("PP stage", "{stage}")),
    ("microbatches in flight", "{in_flight}"),
    ("planned peak MiB", "{planned_mib:.1f}"),
    ("measured peak MiB", "{measured_mib:.1f}"),
    ("error", "{error:+.1%}"),
]


def main(argv=None) -> None:
    args = _parse_args(argv)
    rows, start = [], time.perf_counter()
    measured = {}
    for name in args.jobs:
        measured[name] = measure(args, name)
        rows += compare(name, plan(args, name), measured[name])
    print(
        f"Planned vs measured peak per rank: debug model, {args.layers} decoder "
        f"layers, seq_len {args.seq_len}, {args.images[0]} images of "
        f"{args.tokens_per_image} tokens a row ({time.perf_counter() - start:.0f} s)\n"
    )
    print(_harness.table(_COLUMNS, rows, left=["job"]))
    result = {"settings": vars(args), "rows": rows, "measured": measured}
    _harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
