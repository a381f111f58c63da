"""The memory planner against the measurement: activations per rank, by CP and vision.

``memory_per_rank.py`` measures the debug job's activation bytes per rank on
real gloo ranks (``outputs/benchmarks/memory_per_rank.json``). This script
plans the same job (``_harness.degree_job``: packed.toml at the CP degree, float32
parameters, RoPE tables and decoder layers fitted as there) on the same rows
(``--images`` of ``--tokens-per-image`` placeholders, spread evenly), read from
that JSON's settings, with ``torchtitan_ext.tools.estimate`` (one forward +
backward under FakeTensorMode on the fake process group), and prints both per
(CP, images, mode), each figure on the rank where it is largest, as
``memory_per_rank`` reports it, with the planner / measured ratios.

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


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--measured",
        type=Path,
        default=REPO / "outputs" / "benchmarks" / "memory_per_rank.json",
        help="memory_per_rank.py's JSON; its settings are the planner's",
    )
    parser.add_argument("--cp", type=int, nargs="+", help="default: the JSON's")
    parser.add_argument("--images", type=int, nargs="+", help="default: the JSON's")
    parser.add_argument(
        "--json",
        type=Path,
        default=REPO / "outputs" / "benchmarks" / "memory_planner_check.json",
    )
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
    _, _, estimates = plan_job(
        config,
        images=images,
        tokens_per_image=settings.tokens_per_image,
        world_size=cp,
    )
    return estimates


def _state(estimate) -> int:
    return estimate.parameters + estimate.gradients + estimate.optimizer


def _compare(measured_row: dict, estimates) -> dict:
    ranks = measured_row["ranks"]
    measured = {
        "decoder": max(r["decoder_activation_bytes"] for r in ranks),
        "vision": max(r["vision_activation_bytes"] for r in ranks),
        "state": max(sum(r["state_bytes"].values()) for r in ranks),
    }
    planned = {
        "decoder": max(e.decoder_activations for e in estimates),
        "vision": max(e.vision_activations for e in estimates),
        "state": max(_state(e) for e in estimates),
    }
    return {
        **{k: measured_row[k] for k in ("cp", "images", "vision")},
        "planned_bytes": planned,
        "measured_bytes": measured,
        "ratio": {k: planned[k] / measured[k] for k in planned},
        "planned_per_rank": [
            {
                "rank": e.rank,
                "decoder": e.decoder_activations,
                "vision": e.vision_activations,
                "state": _state(e),
            }
            for e in estimates
        ],
        "measured_per_rank": [
            {
                "decoder": r["decoder_activation_bytes"],
                "vision": r["vision_activation_bytes"],
                "state": sum(r["state_bytes"].values()),
            }
            for r in ranks
        ],
    }


def _cells(row: dict) -> list[str]:
    cells = [str(row["cp"]), str(row["images"]), row["vision"]]
    for kind in ("decoder", "vision", "state"):
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
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"measured": str(args.measured), "rows": rows}, indent=2)
    )
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
