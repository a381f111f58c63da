"""Vision forward + backward time per rank, sharded vs replicated CP vision.

Sharded vision (``--parallelism.context_parallel_vision sharded``) should cut
each CP rank's vision work to its share of the images, at the price of one
exchange of the projected rows. Each ``--cp`` degree runs in one torchrun
launch on gloo ranks with the real Trainer and model (``_cp_degrees``); for
each ``--images`` count each rank times the vision path alone, forward and
backward, in both modes alternating in pairs (``_pairs``):

- the path: encoder and adapter (``_get_vision_features``), projection, norm,
  in sharded mode the exchange, and the bank-row gather into the token
  embeddings (``_inject_vision``), called as ``MuseGlimmerModel.forward`` calls
  them (its ``_vision_bank_indices_BL`` and ``_cp_vision_share`` set, inside
  the Trainer's spmd context and ``multimodal_context``) on the inputs the
  Trainer's post-processing gives this rank in that mode. The embeddings are
  a fixed random non-leaf ``[1, seq_len / cp, dim]`` tensor, and backward runs
  from a fixed random gradient of the injection's output;
- FSDP as in training: the encoder and adapter are FSDP units of their own and
  run with their parameter all-gathers and gradient reduce-scatters (alike in
  both modes); the projection and norm belong to the root unit, unsharded
  before the timed region (its all-gather is decoder work) and reduce-scattered
  by FSDP's end-of-backward callback inside it;
- a barrier before each timed region; per pair the slowest rank's time in each
  mode; the ratio is sharded over replicated per pair, its median and
  quartiles. CP1 (where the modes coincide) is timed as the reference, in its
  own launch, so "vs CP1" compares separate launches (and a lone CP1 rank
  runs as many threads as there are cores; each of N ranks, 1/N of them).

Every pass carries fixed costs, alike in both modes: FSDP's collectives for the
encoder, adapter and root units and the Python dispatch of a few hundred ops
(about 0.6 s a pass at CP2 with one image on this project's busy 2-core host),
so the ratio falls towards the share of images as their number grows.

    python benchmarks/vision_time_per_rank.py               # table + JSON
    python benchmarks/vision_time_per_rank.py --seq-len 512 --cp 1 2 \\
        --images 4 --tokens-per-image 16 --pairs 3
"""

import argparse
import time

import _cp_degrees  # benchmarks/, first on sys.path when run as a script
import _cp_step
import torch
from _vision_modes import (
    compare_slowest_ranks,
    modes_at,
    ratio_cells,
    set_vision_mode,
    time_in_pairs,
    train_step_in,
    with_vision_share,
)

_PHASES = ("forward_ms", "backward_ms", "total_ms")


def _parse_args(argv=None) -> argparse.Namespace:
    parser = _cp_degrees.parser(
        __doc__,
        seq_len=8192,
        cp=[1, 2, 4],
        images=[64],
        json_name="vision_time_per_rank.json",
    )
    parser.add_argument("--pairs", type=int, default=7, help="timed pairs of modes")
    return _cp_degrees.parse(parser, argv)


# ---------------------------------------------------------------- worker side


def _vision_pass(trainer, model_inputs, h0_BLD, grad_BLD) -> dict[str, float]:
    """One forward + backward of the vision path on this rank's inputs (ms)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.common.multimodal import multimodal_context

    model = trainer.model_parts[0]
    tokens_BL, _, extra = model_inputs
    vision_mask_BL = tokens_BL == extra["special_tokens"]["image_id"]
    if isinstance(model, FSDPModule):
        # The root unit holds the projection and norm beside the embeddings and
        # the head: its all-gather is decoder work, left out of the timing.
        model.unshard()
    h_BLD = h0_BLD.clone().requires_grad_()
    # A non-leaf to write into, as the embedding output in the model.
    h_in_BLD = h_BLD.clone()
    with trainer.train_context(), multimodal_context():
        model._vision_bank_indices_BL = extra["vision_bank_indices"]
        model._cp_vision_share = extra.get("cp_vision_share")
        try:
            _cp_step.barrier()
            start = time.perf_counter()
            features = model._get_vision_features(
                extra["pixel_values"], extra["grid_thw"]
            )
            out_BLD = model._inject_vision(h_in_BLD, features, vision_mask_BL)
            _cp_step.synchronize(trainer)
            forward_end = time.perf_counter()
            out_BLD.backward(grad_BLD)
            _cp_step.synchronize(trainer)
            end = time.perf_counter()
        finally:
            model._vision_bank_indices_BL = None
            model._cp_vision_share = None
    trainer.optimizers.zero_grad()
    return {
        "forward_ms": (forward_end - start) * 1e3,
        "backward_ms": (end - forward_end) * 1e3,
        "total_ms": (end - start) * 1e3,
    }


def _measure_images(args, trainer, modes: list[str], images: int) -> dict:
    """Each mode's model inputs first (untimed), then the passes in pairs."""
    batch = _cp_degrees.synthetic_batch(
        trainer, args.seq_len, images, args.tokens_per_image
    )
    model_inputs = {}
    for mode in modes:
        set_vision_mode(trainer, mode)
        model_inputs[mode] = trainer.post_dataloading_process(
            *with_vision_share(trainer, batch)
        )
    tokens_BL = model_inputs[modes[0]][0]
    generator = torch.Generator().manual_seed(1)
    h0_BLD, grad_BLD = (
        torch.randn(*tokens_BL.shape, trainer.model_config.dim, generator=generator).to(
            trainer.device
        )
        for _ in range(2)
    )

    def timed(mode: str) -> dict[str, float]:
        return _vision_pass(trainer, model_inputs[mode], h0_BLD, grad_BLD)

    for mode in modes:  # untimed: first-call allocations at this size
        timed(mode)
    share = model_inputs[modes[-1]][2].get("cp_vision_share")
    return {
        "images": images,
        "image_range": share.image_range if share else [0, images],
        "times": time_in_pairs(trainer, modes, args.pairs, timed),
    }


def _measure(args: argparse.Namespace, trainer) -> list[dict]:
    modes = modes_at(trainer, args.vision)
    # One-time work (FSDP lazy init, optimizer state) stays out: a step per mode.
    warm_up = _cp_degrees.synthetic_batch(
        trainer, min(args.seq_len, 1024), 1, args.tokens_per_image
    )
    for mode in modes:
        train_step_in(trainer, mode, warm_up)
    return [_measure_images(args, trainer, modes, images) for images in args.images]


# ---------------------------------------------------------------- driver side


def _rows(args, per_cp: dict[int, list[list[dict]]]) -> list[dict]:
    rows = []
    for cp, ranks in per_cp.items():
        for rank_rows in zip(*ranks, strict=True):
            images = rank_rows[0]["images"]
            rows.append(
                {
                    "cp": cp,
                    "images": images,
                    "vision_tokens": images * args.tokens_per_image,
                    **compare_slowest_ranks([r["times"] for r in rank_rows], _PHASES),
                    "image_ranges": [r["image_range"] for r in rank_rows],
                    "ranks": rank_rows,
                }
            )
    base = {r["images"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        for mode in args.vision:
            if r["images"] in base and f"{mode}_total_ms" in r:
                r[f"{mode}_vs_cp1"] = (
                    r[f"{mode}_total_ms"] / base[r["images"]]["replicated_total_ms"]
                )
    return rows


def _mode_cells(r: dict, mode: str) -> list[str]:
    if f"{mode}_total_ms" not in r:
        return ["-"] * 3
    vs_cp1 = r.get(f"{mode}_vs_cp1")
    return [
        f"{r[f'{mode}_forward_ms']:.1f} / {r[f'{mode}_backward_ms']:.1f}",
        f"{r[f'{mode}_total_ms']:.1f}",
        f"{vs_cp1:.2f}x" if vs_cp1 is not None else "-",
    ]


def _table(rows: list[dict]) -> str:
    columns = [
        *("CP", "images", "vision tokens"),
        *("replicated fwd / bwd ms", "replicated ms", "vs CP1"),
        *("sharded fwd / bwd ms", "sharded ms", "vs CP1"),
        *("sharded / replicated", "quartiles"),
    ]
    cells = [
        [
            *(str(r["cp"]), str(r["images"]), str(r["vision_tokens"])),
            *_mode_cells(r, "replicated"),
            *_mode_cells(r, "sharded"),
            *ratio_cells(r),
        ]
        for r in sorted(rows, key=lambda r: (r["images"], r["cp"]))
    ]
    return _cp_degrees.table(columns, cells)


def _report(args, per_cp: dict[int, list[list[dict]]]) -> tuple[str, list[dict]]:
    rows = _rows(args, per_cp)
    header = (
        f"seq_len {args.seq_len}, {args.tokens_per_image} tokens per image, fp32; "
        "times: median over pairs of the slowest rank's; sharded / replicated: "
        f"median (and quartiles) of {args.pairs} alternated pairs' ratios"
    )
    return header + "\n" + _table(rows), rows


def main(argv=None) -> None:
    _cp_degrees.main(__file__, argv, _parse_args, _measure, _report)


if __name__ == "__main__":
    main()
