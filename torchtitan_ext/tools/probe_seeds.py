"""Does a job learn the vision path, seed after seed? The vision probe over N seeds.

``python -m torchtitan_ext.tools.probe_seeds --out DIR [--seeds 0 1 2 3]
[--jobs fsdp2 fsdp2_cp2] [--steps 150] [--fp32] [--margin M]``

Per seed: a seed checkpoint, each job trained from it (``probe_training_args``;
the jobs' bf16 unless ``--fp32``) and probed on the embedded and on held-out
images; a run has learned when its held-out gap exceeds ``--margin``. Writes
``DIR/probe_seeds.json``; runs already in ``DIR`` are probed, not retrained.
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from torchtitan_ext.tools.parity.launch import REPO_ROOT, RUN_TRAIN, RunSpec, launch_run
from torchtitan_ext.tools.vision_probe import (
    HELDOUT_SEED,
    LEARNED_MARGIN,
    probe_training_args,
    run_probe,
    seed_checkpoint_args,
)

__all__ = ["main"]

_SHARDED_VISION = "--parallelism.context_parallel_vision sharded"
# Job name: its TOML file and extra flags (the ranks follow from both).
_JOBS = {
    "fsdp2": ("fsdp2.toml", ""),
    "fsdp2_cp2": ("fsdp2_cp2.toml", ""),
    "fsdp2_cp2_sharded_vision": ("fsdp2_cp2.toml", _SHARDED_VISION),
    "cp2": ("cp2.toml", ""),
    "cp2_sharded_vision": ("cp2.toml", _SHARDED_VISION),
    "packed": ("packed.toml", ""),
    # Reorder controls for FSDP2 x CP2: the same global batch, other rounding.
    "fsdp2_tp2_sp": ("fsdp2.toml", "--parallelism.tensor_parallel_degree 2"),
    "fsdp2_cp2_headtail": (
        "fsdp2_cp2.toml",
        "--parallelism.context_parallel_load_balancer headtail",
    ),
}
_HEADER = (
    f"seed | {'job':<24} | true emb | shuf emb | gap emb | true held "
    "| shuf held | gap held | learned"
)


def _trained(out: Path, name: str, job: str, args: list[str], step: int) -> Path:
    """The run's checkpoint at ``step``, trained unless ``out`` holds it."""
    checkpoint = out / name / "checkpoint" / f"step-{step}"
    if not (checkpoint / ".metadata").is_file():
        toml, options = _JOBS[job]
        toml = str(REPO_ROOT / "train_configs" / toml)
        spec = RunSpec(config_file=toml, options=options)
        argv = [str(RUN_TRAIN), f"--dump_folder={out / name}", *spec.option_args()]
        log = out / f"{name}.log"
        record = launch_run(
            name, spec.job_env(), [*argv, *args], log, timeout=3600, echo=False
        )
        if not record.ok:
            raise RuntimeError(record.failure())
    return checkpoint


def _format_row(row: dict) -> str:
    e, h = row["embedded"], row["heldout"]
    return (
        f"{row['seed']:>4} | {row['job']:<24} | {e['true_loss']:8.4f} | "
        f"{e['shuffled_loss']:8.4f} | {e['difference']:+7.4f} | "
        f"{h['true_loss']:9.4f} | {h['shuffled_loss']:9.4f} | "
        f"{h['difference']:+8.4f} | {'yes' if row['learned'] else 'no'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.probe_seeds",
        description="The vision probe over several seeds and jobs.",
    )
    parser.add_argument("--out", type=Path, required=True, help="runs and JSON")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument(
        "--jobs", nargs="+", choices=sorted(_JOBS), default=["fsdp2", "fsdp2_cp2"]
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--fp32", action="store_true", help="float32, not bf16")
    parser.add_argument("--margin", type=float, default=LEARNED_MARGIN)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        initial = _trained(out, f"seed{seed}", "packed", seed_checkpoint_args(seed), 0)
        train_args = probe_training_args(
            steps=args.steps, seed_checkpoint=initial, fp32=args.fp32, seed=seed
        )
        for job in args.jobs:
            checkpoint = _trained(out, f"{job}_seed{seed}", job, train_args, args.steps)
            embedded = run_probe(checkpoint)
            heldout = run_probe(checkpoint, heldout_seed=HELDOUT_SEED)
            rows.append(
                {
                    "seed": seed,
                    "job": job,
                    "learned": heldout.difference > args.margin,
                    "embedded": asdict(embedded),
                    "heldout": asdict(heldout),
                }
            )
            print(_format_row(rows[-1]), flush=True)
    summary = {j: sum(r["learned"] for r in rows if r["job"] == j) for j in args.jobs}
    report = {
        "steps": args.steps,
        "precision": "float32" if args.fp32 else "bf16 (job default)",
        "margin": args.margin,
        "runs": rows,
        "learned": summary,
    }
    (out / "probe_seeds.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join([_HEADER, *map(_format_row, rows)]))
    for job, learned in summary.items():
        print(f"{job}: learned the vision path in {learned} of {len(args.seeds)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
