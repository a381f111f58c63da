"""Training step time per rank, sharded vs replicated CP vision, at CP2 and CP4.

Sharded vision must not slow a step with few images (the exchange and, on
ranks without an image, a blank image's encoding are its overhead) and should
speed up one with many (each rank encodes a share). Each ``--cp`` degree runs
in one torchrun launch on gloo ranks with the real Trainer (``_cp_degrees``);
for each ``--images`` count, after ``--warmup`` untimed steps per mode, every
timed step is one real ``Trainer.train_step`` (``_cp_step.train_step``:
post-processing, forward, backward, clipping, optimizer, with a barrier
before it) on a fresh copy of the synthetic row, carrying this rank's share
of the images in sharded mode, the modes alternating in pairs (``_pairs``).
Per step the slowest rank's time; the ratio is sharded over replicated per
pair, its median and quartiles. Before each step the Trainer's batch agreement
check runs on the CPU row (``_cp_step.batch_agreement``), timed on its own.

Defaults: ``--seq-len 2048`` with 16 tokens per image (64 images fill half
the row, the most the synthetic row allows), 1 and 64 images, 5 pairs, CP2
and CP4: about 10 minutes on this project's 2-core host while other jobs run.
On the CPU debug model the decoder (its eager dense flex attention above all)
dominates the step: at CP2 with 64 images the replicated vision path is about
0.9 s of an 8 s step (``vision_time_per_rank.py`` at the same size), so the gain
at 64 images is a few percent, and a busy host needs more ``--pairs`` to see it.

    python benchmarks/step_time_vision.py                  # table + JSON
    python benchmarks/step_time_vision.py --seq-len 512 --cp 2 --images 1 4 \\
        --tokens-per-image 16 --pairs 2 --warmup 0
"""

import argparse

import _cp_degrees  # benchmarks/, first on sys.path when run as a script
import _cp_step
from _vision_modes import (
    compare_slowest_ranks,
    modes_at,
    ratio_cells,
    time_in_pairs,
    train_step_in,
)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = _cp_degrees.parser(
        __doc__,
        seq_len=2048,
        cp=[2, 4],
        images=[1, 64],
        json_name="step_time_vision.json",
    )
    parser.set_defaults(tokens_per_image=16)
    parser.add_argument("--pairs", type=int, default=5, help="timed pairs of steps")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed steps per mode and images"
    )
    return _cp_degrees.parse(parser, argv)


def _measure_images(args, trainer, modes: list[str], images: int) -> dict:
    batch = _cp_degrees.synthetic_batch(
        trainer, args.seq_len, images, args.tokens_per_image
    )

    def timed(mode: str) -> dict[str, float]:
        return {
            "agreement_ms": _cp_step.batch_agreement(trainer, batch),
            "step_ms": train_step_in(trainer, mode, batch),
        }

    for _ in range(args.warmup):
        for mode in modes:
            timed(mode)
    return {
        "images": images,
        "times": time_in_pairs(trainer, modes, args.pairs, timed),
    }


def _measure(args: argparse.Namespace, trainer) -> list[dict]:
    modes = modes_at(trainer, args.vision)
    return [_measure_images(args, trainer, modes, images) for images in args.images]


def _rows(args, per_cp: dict[int, list[list[dict]]]) -> list[dict]:
    return [
        {
            "cp": cp,
            "images": rank_rows[0]["images"],
            "vision_tokens": rank_rows[0]["images"] * args.tokens_per_image,
            **compare_slowest_ranks(
                [r["times"] for r in rank_rows], ("agreement_ms", "step_ms")
            ),
            "ranks": rank_rows,
        }
        for cp, ranks in per_cp.items()
        for rank_rows in zip(*ranks, strict=True)
    ]


def _table(rows: list[dict]) -> str:
    columns = [
        *("CP", "images", "vision tokens", "replicated step ms", "sharded step ms"),
        *("sharded / replicated", "quartiles", "batch agreement ms", "% of step"),
    ]
    cells = [
        [
            *(str(r["cp"]), str(r["images"]), str(r["vision_tokens"])),
            *(
                f"{r[key]:.0f}" if key in r else "-"
                for key in ("replicated_step_ms", "sharded_step_ms")
            ),
            *ratio_cells(r),
            f"{r['replicated_agreement_ms']:.2f}",
            f"{100 * r['replicated_agreement_ms'] / r['replicated_step_ms']:.3f}%",
        ]
        for r in sorted(rows, key=lambda r: (r["images"], r["cp"]))
    ]
    return _cp_degrees.table(columns, cells)


def _report(args, per_cp: dict[int, list[list[dict]]]) -> tuple[str, list[dict]]:
    rows = _rows(args, per_cp)
    header = (
        f"seq_len {args.seq_len}, {args.tokens_per_image} tokens per image, fp32, "
        f"{args.layers} decoder layers; step: median over {args.pairs} pairs of "
        "the slowest rank's Trainer.train_step; sharded / replicated: median (and "
        "quartiles) of the alternated pairs' ratios"
    )
    return header + "\n" + _table(rows), rows


def main(argv=None) -> None:
    _cp_degrees.main(__file__, argv, _parse_args, _measure, _report)


if __name__ == "__main__":
    main()
