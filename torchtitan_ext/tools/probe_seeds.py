"""Does a job learn the vision path, seed after seed? The vision probe over N seeds.

``python -m torchtitan_ext.tools.probe_seeds --out DIR [--seeds 0 1 2 3]
[--jobs fsdp2 fsdp2_cp2] [--steps 150] [--fp32]``

Per seed: a seed checkpoint on 1 rank (``--debug.seed``), then each job trained
from it with ``vision_probe.probe_training_args`` (one 256-token row per rank,
so FSDP2 and FSDP2xCP2 see the same global batch of 2 rows), by default in the
jobs' own bf16 mixed precision, then the probe on the embedded and on held-out
images. A run counts as having learned the vision path when its held-out gap
(shuffled minus true caption loss) exceeds ``--margin``.

Writes ``DIR/probe_seeds.json`` and prints one row per run and each job's
success rate. Runs already finished in ``DIR`` (their final checkpoint is
there) are probed again, not retrained.
"""

from __future__ import annotations

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


def _train(out: Path, name: str, job: str, args: list[str]) -> Path:
    dump = out / name
    toml, options = _JOBS[job]
    job = RunSpec(config_file=str(REPO_ROOT / "train_configs" / toml), options=options)
    record = launch_run(
        name,
        job.job_env(),
        [str(RUN_TRAIN), f"--dump_folder={dump}", *job.option_args(), *args],
        out / f"{name}.log",
        timeout=3600,
        echo=False,
    )
    if not record.ok:
        raise RuntimeError(record.failure())
    return dump


def _checkpoint(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


def _trained(out: Path, name: str, job: str, args, step: int) -> Path:
    checkpoint = _checkpoint(out / name, step)
    if not (checkpoint / ".metadata").is_file():
        _train(out, name, job, args)
    return checkpoint


def build_parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--fp32", action="store_true", help="float32 parameters instead of bf16"
    )
    parser.add_argument("--margin", type=float, default=LEARNED_MARGIN)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        seed_ckpt = _trained(
            out, f"seed{seed}", "packed", seed_checkpoint_args(seed), 0
        )
        train_args = probe_training_args(
            steps=args.steps, seed_checkpoint=seed_ckpt, fp32=args.fp32, seed=seed
        )
        for job in args.jobs:
            name = f"{job}_seed{seed}"
            checkpoint = _trained(out, name, job, train_args, args.steps)
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
    summary = {
        job: sum(r["learned"] for r in rows if r["job"] == job) for job in args.jobs
    }
    report = {
        "steps": args.steps,
        "precision": "float32" if args.fp32 else "bf16 (job default)",
        "margin": args.margin,
        "runs": rows,
        "learned": summary,
    }
    (out / "probe_seeds.json").write_text(json.dumps(report, indent=2) + "\n")
    print(_HEADER)
    for row in rows:
        print(_format_row(row))
    for job, learned in summary.items():
        print(f"{job}: learned the vision path in {learned} of {len(args.seeds)} seeds")
    return 0


_HEADER = (
    f"seed | {'job':<24} | true emb | shuf emb | gap emb | true held "
    "| shuf held | gap held | learned"
)


def _format_row(row: dict) -> str:
    e, h = row["embedded"], row["heldout"]
    return (
        f"{row['seed']:>4} | {row['job']:<24} | {e['true_loss']:8.4f} | "
        f"{e['shuffled_loss']:8.4f} | {e['difference']:+7.4f} | "
        f"{h['true_loss']:9.4f} | {h['shuffled_loss']:9.4f} | "
        f"{h['difference']:+8.4f} | {'yes' if row['learned'] else 'no'}"
    )


if __name__ == "__main__":
    sys.exit(main())
