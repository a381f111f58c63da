"""Vision, step or preprocessing time per CP rank: what the plug-in's CP vision costs.

Sharded vision should cut a rank's vision work to its share of the images at
the price of one exchange, and not slow a step with few images; the plug-in's
preprocessing should cost nothing beside a step. ``vision`` and ``step`` run
each ``--cp`` degree on its ranks (``_harness.run_degrees``) and time both
modes per ``--images`` count in alternated pairs after warm-up passes (per
pair the slowest rank; sharded / replicated: median and quartiles of the
pairs' ratios):

- ``vision``: the vision path (encoder to the gather into the embeddings, the
  exchange included), forward and backward from a fixed gradient, as
  ``MuseGlimmerModel.forward`` calls it; the FSDP root unsharded before; CP1
  (the replicated path alone) for reference.
- ``step``: one ``Trainer.train_step``, and the batch agreement check apart, on
  the batch as the loader yields it (its samples' digests) and, as the check
  was before them, hashing every pixel.
- ``preprocess``: on a CP job's Trainer (``--config-file``, ``--nproc``;
  ``_harness.run_job``) per dataloader batch torchtitan's and the plug-in's
  ``post_dataloading_process`` in alternated pairs on fresh copies (added:
  their difference per pair, wall and process CPU time, which leaves out other
  processes), the index build and placeholder check alone, and ``train_step``.
  Extra arguments are torchtitan flags.

    python benchmarks/vision_time.py --scope vision      # table + JSON
    python benchmarks/vision_time.py --scope step --seq-len 512 --cp 2 \\
        --images 1 4 --tokens-per-image 16 --pairs 2 --warmup 0
    python benchmarks/vision_time.py --scope preprocess --seq-len 256 --steps 2
"""

import argparse
import functools
import statistics

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _vision_modes import VISION_MODES, modes_at, set_vision_mode, with_vision_share

from torchtitan_ext.muse_glimmer.batch_agreement import SAMPLE_DIGESTS

# scope -> its timed phases (the last one is compared) and its defaults.
SCOPES = {
    "vision": (
        ("forward_ms", "backward_ms", "total_ms"),
        dict(seq_len=8192, cp=[1, 2, 4], images=[64], tokens=64, pairs=7),
    ),
    "step": (
        ("pixel_agreement_ms", "agreement_ms", "step_ms"),
        dict(seq_len=2048, cp=[2, 4], images=[1, 64], tokens=16, pairs=5),
    ),
    "preprocess": ((), dict(pairs=7)),
}


def _parser(argv) -> tuple[argparse.ArgumentParser, str]:
    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument("--scope", choices=SCOPES, default="vision")
    known, _ = scope.parse_known_args(argv)
    json = f"vision_time_{known.scope}.json"
    defaults = dict(SCOPES[known.scope][1])
    pairs = defaults.pop("pairs")
    if known.scope == "preprocess":
        parser = _harness.job_parser(__doc__, json, steps=5)
    else:
        parser = _harness.degree_parser(__doc__, **defaults, json=json)
        parser.add_argument("--warmup", type=int, default=1, help="untimed passes")
    parser.add_argument("--scope", choices=SCOPES, default="vision")
    parser.add_argument("--pairs", type=int, default=pairs, help="alternated pairs")
    return parser, known.scope


def _vision_pass(trainer, model_inputs, h0_BLD, grad_BLD) -> dict[str, float]:
    """One forward + backward of the vision path on this rank's inputs (ms)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.common.multimodal import multimodal_context

    model = trainer.model_parts[0]
    tokens_BL, _, extra = model_inputs
    vision_mask_BL = tokens_BL == extra["special_tokens"]["image_id"]
    if isinstance(model, FSDPModule):
        model.unshard()  # the root unit's all-gather is decoder work
    # A non-leaf to write into, as the embedding output in the model.
    h_in_BLD = h0_BLD.clone().requires_grad_().clone()
    with trainer.train_context(), multimodal_context():
        model._vision_bank_indices_BL = extra["vision_bank_indices"]
        model._cp_vision_share = extra.get("cp_vision_share")

        def forward():
            pixels, grid_thw = extra["pixel_values"], extra["grid_thw"]
            features = model._get_vision_features(pixels, grid_thw)
            return model._inject_vision(h_in_BLD, features, vision_mask_BL)

        try:
            torch.distributed.barrier()
            sync = functools.partial(_harness.synchronize, trainer)
            ms, _ = _harness.forward_backward_ms(forward, grad_BLD, sync)
        finally:
            model._vision_bank_indices_BL = None
            model._cp_vision_share = None
    trainer.optimizers.zero_grad()
    return ms


def _train_step(trainer, mode: str, batch) -> float:
    """One ``Trainer.train_step`` in ``mode`` on a fresh copy of ``batch`` (ms)."""
    return _harness.train_step(trainer, with_vision_share(trainer, batch, mode))


def _timer(args, trainer, modes: list[str], batch):
    """A timer of the scope in a mode, and facts of this rank's row."""
    if args.scope == "step":

        def timed_step(mode: str) -> dict[str, float]:
            check = trainer.batch_agreement.check
            inputs, labels = batch
            pixels = {k: v for k, v in inputs.items() if k != SAMPLE_DIGESTS}
            pixel_ms, _ = _harness.timed_ms(trainer, check, pixels, labels, "a pair")
            agreement_ms, _ = _harness.timed_ms(trainer, check, *batch, "a pair")
            step_ms = _train_step(trainer, mode, batch)
            return {
                "pixel_agreement_ms": pixel_ms,
                "agreement_ms": agreement_ms,
                "step_ms": step_ms,
            }

        return timed_step, {}
    inputs = {  # each mode's model inputs, untimed
        mode: trainer.post_dataloading_process(*with_vision_share(trainer, batch, mode))
        for mode in modes
    }
    generator = torch.Generator().manual_seed(1)
    shape_BLD = (*inputs[modes[0]][0].shape, trainer.model_config.dim)
    h0_BLD, grad_BLD = (
        torch.randn(*shape_BLD, generator=generator).to(trainer.device)
        for _ in range(2)
    )
    share = inputs[modes[-1]][2].get("cp_vision_share")
    images = len(batch[0]["grid_thw"])

    def timed(mode: str) -> dict[str, float]:
        set_vision_mode(trainer, mode)
        return _vision_pass(trainer, inputs[mode], h0_BLD, grad_BLD)

    return timed, {"image_range": share.image_range if share else [0, images]}


def _measure(args: argparse.Namespace, trainer) -> list[dict]:
    modes = modes_at(trainer, args.vision)
    if args.scope == "vision":
        # One-time work (FSDP lazy init, optimizer state) stays out.
        warm_up = _harness.row_batch(args, trainer, 1, min(args.seq_len, 1024))
        for mode in modes:
            _train_step(trainer, mode, warm_up)
    rows = []
    for images in args.images:
        batch = _harness.row_batch(args, trainer, images)
        timed, facts = _timer(args, trainer, modes, batch)
        for _ in range(args.warmup):
            for mode in modes:
                timed(mode)
        variants = {mode: functools.partial(timed, mode) for mode in modes}
        times = _harness.in_pairs(variants, args.pairs)
        rows.append({"images": images, **facts, "times": times})
    return rows


def _row(args, rank_rows: list[dict]) -> dict:
    """One CP and images: each mode's median over pairs of the slowest rank's
    times, and sharded over replicated per pair of the last phase."""
    phases, _ = SCOPES[args.scope]
    total = phases[-1]
    slowest = {
        (mode, phase): [
            max(rank[phase] for rank in pair)
            for pair in zip(*(r["times"][mode] for r in rank_rows), strict=True)
        ]
        for mode in rank_rows[0]["times"]
        for phase in phases
    }
    row = {f"{m}_{p}": statistics.median(t) for (m, p), t in slowest.items()}
    if ("sharded", total) in slowest:
        pair = slowest["sharded", total], slowest["replicated", total]
        ratio, quartiles = _harness.median_pair_ratio(*pair)
        row["sharded_ratio"], row["sharded_ratio_quartiles"] = ratio, quartiles
    for check in ("pixel_agreement", "agreement"):
        if f"replicated_{check}_ms" in row:
            check_ms = row[f"replicated_{check}_ms"]
            row[f"{check}_pct_of_step"] = 100 * check_ms / row[f"replicated_{total}"]
    row["image_ranges"] = [r.get("image_range") for r in rank_rows]
    return row | {"ranks": rank_rows}


def _report(args, rows: list[dict]) -> str:
    phases, _ = SCOPES[args.scope]
    columns = [("CP", "{cp}"), ("images", "{images}")]
    columns.append(("vision tokens", "{vision_tokens}"))
    for mode in VISION_MODES:
        for phase in phases if args.scope == "vision" else phases[-1:]:
            title = f"{mode} {phase.removesuffix('_ms')} ms"
            columns.append((title, f"{{{mode}_{phase}:.1f}}"))
    columns.append(("sharded / replicated", "{sharded_ratio:.2f}x"))
    quartiles = "{sharded_ratio_quartiles[0]:.2f}-{sharded_ratio_quartiles[1]:.2f}x"
    columns.append(("quartiles", quartiles))
    if args.scope == "step":
        columns.append(("pixels hashed ms", "{replicated_pixel_agreement_ms:.2f}"))
        columns.append(("% of step", "{pixel_agreement_pct_of_step:.3f}%"))
        columns.append(("sample digests ms", "{replicated_agreement_ms:.2f}"))
        columns.append(("% of step", "{agreement_pct_of_step:.3f}%"))
    header = (
        f"{args.scope} time: seq_len {args.seq_len}, {args.tokens_per_image} tokens "
        f"per image, fp32, {args.layers} decoder layers; times: median over "
        f"{args.pairs} pairs of the slowest rank's; sharded / replicated: median "
        "(and quartiles) of the alternated pairs' ratios"
    )
    order = sorted(rows, key=lambda r: (r["images"], r["cp"]))
    return header + "\n" + _harness.table(columns, order)


def _preprocess_step(trainer, cpu_batch, pairs: int) -> dict:
    """Both post-processings, the index build and the check on one batch."""
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
    up, plug = _harness.in_pairs(sides, pairs).values()
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


def _preprocess(args, trainer) -> dict:
    """This rank's steps, their medians and the medians' share of the step."""
    batches = trainer.batch_generator(trainer.dataloader)
    steps = [
        _preprocess_step(trainer, next(batches), args.pairs)
        for _ in range(args.warmup + args.steps)
    ][args.warmup :]
    timed = [key for key in steps[0] if key.endswith("_ms")]  # not the pairs
    median = {key: statistics.median(step[key] for step in steps) for key in timed}
    pct = {key: median[f"{key}_ms"] for key in ("added", "added_cpu", "index")}
    return {
        "rank": torch.distributed.get_rank(),
        **median,
        **{f"{k}_pct_of_step": 100 * ms / median["step_ms"] for k, ms in pct.items()},
        **{
            f"{key}_quartiles_all_pairs": statistics.quantiles(
                [pair for step in steps for pair in step[f"{key}_pairs"]], n=4
            )
            for key in ("added_ms", "added_cpu_ms")
        },
        "steps": steps,
    }


# "q1 / median / q3" of all pairs' added time; .format(key) gives the cell.
_QUARTILES = " / ".join(f"{{{{{{0}}_quartiles_all_pairs[{i}]:.2f}}}}" for i in range(3))
_PREPROCESS_COLUMNS = [
    ("rank", "{rank}"),
    ("upstream post ms", "{upstream_post_ms:.2f}"),
    ("plug-in post ms", "{plugin_post_ms:.2f}"),
    ("added ms", "{added_ms:.2f}"),
    ("added CPU ms", "{added_cpu_ms:.2f}"),
    ("index build ms", "{index_ms:.2f}"),
    ("step ms", "{step_ms:.1f}"),
    ("added %", "{added_pct_of_step:.3f}%"),
    ("added CPU %", "{added_cpu_pct_of_step:.3f}%"),
    ("index %", "{index_pct_of_step:.4f}%"),
    ("added CPU ms quartiles", _QUARTILES.format("added_cpu_ms")),
]


def _preprocess_report(args, job: dict, ranks: list[dict]) -> tuple[str, dict]:
    lines = [
        f"median over {args.steps} steps (post-processing: median of {args.pairs} "
        f"alternated pairs per step); images per batch "
        f"{[s['images'] for s in ranks[0]['steps']]}",
        _harness.table(_PREPROCESS_COLUMNS, ranks),
    ]
    return "\n".join(lines), {"ranks": ranks}


def main(argv=None) -> None:
    parser, scope = _parser(argv)
    if scope == "preprocess":
        _harness.run_job(parser, argv, _preprocess, _preprocess_report)
    else:
        args = _harness.parse_row(parser, argv)
        _harness.run_degrees(args, _measure, _row, _report)


if __name__ == "__main__":
    main()
