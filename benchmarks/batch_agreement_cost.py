"""The batch agreement's host cost for one row of a 30B_mm job, beside its step.

The host batch of one row as the loader yields it: ``--images`` photos at the
released processor's grid for ``--photo`` pixels (each side floored to 28 px:
a 768x1024 photo is 54x72 patches, 972 tokens), float32 pixels, the job's
seq_len of tokens; each raw sample is a real photo (scikit-image's ``coffee``,
resized with LANCZOS) encoded as JPEG and a caption. Timed, median of
``--repeats``: the check as it was (every pixel hashed on the training thread),
the fingerprint now (tokens, labels, grids, sample digests) and the samples'
digests, made where each sample is read (on the training thread too while
``num_workers`` is 0, as in every TOML). Set beside the roofline's step
estimate of ``--job`` at ``--gpus`` (``tools/estimate/roofline.py``). The
gather of the 4-value fingerprint over gloo is timed by ``vision_time.py
--scope step``, on real ranks.

    python benchmarks/batch_agreement_cost.py            # table + JSON
"""

import argparse
import io
import statistics
import time
from pathlib import Path

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from PIL import Image

JOB = "train_configs/30b_mm_64k_fsdp4_cp8_tp2_sp.toml"
PATCH, MERGE = 14, 2


def _raw_sample(index: int, width: int, height: int, quality: int) -> dict:
    """A cc12m record: a real photo's JPEG bytes and a caption."""
    from skimage import data

    photo = Image.fromarray(data.coffee()).resize((width, height), Image.LANCZOS)
    jpeg = io.BytesIO()
    photo.save(jpeg, format="JPEG", quality=quality)
    caption = f"a cup of coffee on a saucer, photo {index}"
    key = f"{index:09d}"
    return {
        "__key__": key,
        "__url__": "cc12m-000.tar",
        "jpg": jpeg.getvalue(),
        "txt": caption,
    }


def _host_row(args, seq_len: int):
    """The raw samples and the host batch of one row."""
    from torchtitan_ext.muse_glimmer.batch_agreement import (
        SAMPLE_DIGESTS,
        sample_digest,
    )

    width, height = map(int, args.photo.split("x"))
    samples = [_raw_sample(i, width, height, args.quality) for i in range(args.images)]
    grid_h = height // (PATCH * MERGE) * MERGE
    grid_w = width // (PATCH * MERGE) * MERGE
    generator = torch.Generator().manual_seed(0)
    tokens_BL = torch.randint(0, 200_000, (1, seq_len), generator=generator)
    input_dict = {
        "input": tokens_BL,
        "pixel_values": torch.rand(
            args.images, grid_h * grid_w, 3 * 2 * PATCH * PATCH, generator=generator
        ),
        "grid_thw": torch.tensor([[1, grid_h, grid_w]] * args.images),
        SAMPLE_DIGESTS: torch.tensor([sample_digest(s) for s in samples]),
    }
    return samples, (input_dict, tokens_BL.roll(-1, 1)), (grid_h, grid_w)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", default=JOB)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--photo", default="1024x768", help="width x height, px")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--json", default=str(_harness.OUTPUTS / "batch_agreement.json")
    )
    args = parser.parse_args(argv)

    config = _harness.load_config(["--job.config_file", args.job])  # CPU backend first
    from torchtitan_ext.muse_glimmer.batch_agreement import (
        SAMPLE_DIGESTS,
        batch_fingerprint,
        sample_digest,
    )
    from torchtitan_ext.tools.estimate.roofline import Hardware, step_time

    samples, (inputs, labels), (grid_h, grid_w) = _host_row(
        args, config.training.seq_len
    )
    tokens_per_image = grid_h * grid_w // MERGE**2
    step_s = step_time(config, args.gpus, args.images, tokens_per_image, Hardware())
    pixels = {k: v for k, v in inputs.items() if k != SAMPLE_DIGESTS}
    checks = {
        "every pixel hashed (before)": lambda: batch_fingerprint(pixels, labels),
        "fingerprint (now)": lambda: batch_fingerprint(inputs, labels),
        "sample digests (now, loader)": lambda: [sample_digest(s) for s in samples],
    }
    rows = [
        {"check": name, "ms": _median_ms(fn, args.repeats)}
        for name, fn in checks.items()
    ]
    rows.append({"check": "now, both", "ms": rows[1]["ms"] + rows[2]["ms"]})
    for row in rows:
        row["pct_of_step"] = 100 * row["ms"] / (step_s.seconds * 1e3)
    facts = {
        "job": args.job,
        "gpus": args.gpus,
        "seq_len": config.training.seq_len,
        "images": args.images,
        "grid": [grid_h, grid_w],
        "tokens_per_image": tokens_per_image,
        "pixel_mb": inputs["pixel_values"].numel() * 4 / 1e6,
        "jpeg_mb": sum(len(s["jpg"]) for s in samples) / 1e6,
        "roofline_step_s": step_s.seconds,
    }
    print(
        f"{args.job} on {args.gpus} GPUs: one row of {facts['seq_len']} "
        f"tokens, {args.images} photos of {args.photo} px -> {grid_h}x{grid_w} patches "
        f"({tokens_per_image} tokens): {facts['pixel_mb']:.0f} MB of float32 pixels, "
        f"{facts['jpeg_mb']:.1f} MB of JPEG; roofline step {step_s.seconds:.2f} s; "
        f"median of {args.repeats}"
    )
    print(
        _harness.table(
            [
                ("check", "{check}"),
                ("ms", "{ms:.1f}"),
                ("% of step", "{pct_of_step:.3f}%"),
            ],
            rows,
            left=("check",),
        )
    )
    _harness.write_json(Path(args.json), {**facts, "rows": rows})


if __name__ == "__main__":
    main()
