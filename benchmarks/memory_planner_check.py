"""The memory planner against the measurement: activations per rank, by CP and vision.

Plans the job ``memory_per_rank.py`` measured (its JSON's settings: packed.toml
at each CP degree, fitted as there, the same rows) with
``torchtitan_ext.tools.estimate`` and prints both per (CP, images, mode), each
figure on the rank where it is largest, with the planner / measured ratios.

    python benchmarks/memory_planner_check.py         # table + JSON
"""

import argparse
import json
import sys
import time
from pathlib import Path

import _harness  # benchmarks/, first on sys.path when run as a script
from _harness import MIB, PACKED_JOB, REPO

_COLUMNS = (
    *("CP", "images", "vision"),
    *("decoder act. MiB planned", "measured", "ratio"),
    *("vision act. MiB planned", "measured", "ratio"),
    *("params+grads+opt MiB planned", "measured", "ratio"),
)
# Each compared figure, from a measured rank (JSON) and from a planned one.
_MEASURED = {
    "decoder": lambda r: r["decoder_activation_bytes"],
    "vision": lambda r: r["vision_activation_bytes"],
    "state": lambda r: sum(r["state_bytes"].values()),
}
_PLANNED = {
    "decoder": lambda e: e.decoder_activations,
    "vision": lambda e: e.vision_activations,
    "state": lambda e: e.parameters + e.gradients + e.optimizer,
}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out = REPO / "outputs" / "benchmarks"
    parser.add_argument(
        "--measured",
        type=Path,
        default=out / "memory_per_rank.json",
        help="memory_per_rank.py's JSON; its settings are the planner's",
    )
    parser.add_argument("--cp", type=int, nargs="+", help="default: the JSON's")
    parser.add_argument("--images", type=int, nargs="+", help="default: the JSON's")
    parser.add_argument("--json", type=Path, default=out / "memory_planner_check.json")
    return parser.parse_args(argv)


def _plan(settings: argparse.Namespace, cp: int, images: int, vision: str):
    """The planner's estimates of every simulated rank of one setting."""
    from torchtitan_ext.tools.estimate.cli import plan_job
    from torchtitan_ext.tools.simulated_cluster import load_job

    job_args = _harness.degree_job(settings, cp, dump=str(REPO / "outputs"))
    config = load_job(
        ["--job.config_file", PACKED_JOB, *job_args]
        + ["--parallelism.context_parallel_vision", vision]
    )
    _harness.fit_model(config.model_spec.model, settings.seq_len, settings.layers)
    tokens = settings.tokens_per_image
    return plan_job(config, images=images, tokens_per_image=tokens, world_size=cp)[2]


def _compare(measured_row: dict, estimates) -> dict:
    ranks = measured_row["ranks"]
    measured = {k: max(map(f, ranks)) for k, f in _MEASURED.items()}
    planned = {k: max(map(f, estimates)) for k, f in _PLANNED.items()}
    return {
        **{k: measured_row[k] for k in ("cp", "images", "vision")},
        "planned_bytes": planned,
        "measured_bytes": measured,
        "ratio": {k: planned[k] / measured[k] for k in planned},
        "planned_per_rank": [
            {"rank": e.rank, **{k: f(e) for k, f in _PLANNED.items()}}
            for e in estimates
        ],
        "measured_per_rank": [{k: f(r) for k, f in _MEASURED.items()} for r in ranks],
    }


def _cells(row: dict) -> list[str]:
    cells = [str(row["cp"]), str(row["images"]), row["vision"]]
    for kind in _PLANNED:
        cells += [
            f"{row['planned_bytes'][kind] / MIB:.1f}",
            f"{row['measured_bytes'][kind] / MIB:.1f}",
            f"{row['ratio'][kind]:.3f}",
        ]
    return cells


def main(argv=None) -> None:
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    args = _parse_args(argv)
    measured = json.loads(args.measured.read_text())
    settings = argparse.Namespace(**measured["settings"])
    cps = args.cp or settings.cp
    images = args.images or settings.images
    rows, start = [], time.perf_counter()
    for row in measured["rows"]:
        if row["cp"] not in cps or row["images"] not in images:
            continue
        if row["cp"] == 1 and row["vision"] == "sharded":
            continue  # CP1 runs the replicated path in both modes
        estimates = _plan(settings, row["cp"], row["images"], row["vision"])
        rows.append(_compare(row, estimates))
        print(
            f"CP{row['cp']} {row['images']} images {row['vision']}: "
            f"{time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
    print(
        f"Planner vs memory_per_rank.py ({args.measured.name}): seq_len "
        f"{settings.seq_len}, {settings.tokens_per_image} tokens per image, "
        f"{settings.layers} decoder layers; each figure on the rank where it is "
        "largest; activations without the eager attention kernel's scratch "
        "(measured) / flex attention's fake kernel (planned).\n"
    )
    print(_harness.table(_COLUMNS, map(_cells, rows), left=["vision"]))
    print(f"\nplanned in {time.perf_counter() - start:.0f} s")
    _harness.write_json(args.json, {"measured": str(args.measured), "rows": rows})


if __name__ == "__main__":
    main()
