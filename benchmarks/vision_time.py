"""Vision time or training step time per rank, sharded vs replicated CP vision.

Sharded vision (``--parallelism.context_parallel_vision sharded``) should cut
each CP rank's vision work to its share of the images, at the price of one
exchange of the projected rows, and must not slow a step with few images (the
exchange and, on ranks without an image, a blank image's encoding are its
overhead). Each ``--cp`` degree runs on its own gloo ranks with the real
Trainer (``_harness.run_degrees``); for each ``--images`` count each rank times
one scope in both modes, alternating in pairs, after untimed warm-up passes:

- ``--scope vision``: the vision path alone, forward and backward: encoder and
  adapter (``_get_vision_features``), projection, norm, in sharded mode the
  exchange, and the bank-row gather into the token embeddings
  (``_inject_vision``), called as ``MuseGlimmerModel.forward`` calls them,
  inside the Trainer's spmd context, on the inputs the Trainer's
  post-processing gives this rank in that mode. The embeddings are a fixed
  random non-leaf ``[1, seq_len / cp, dim]`` tensor; backward runs from a fixed
  random gradient. FSDP as in training: the encoder and adapter are units of
  their own, with their all-gathers and reduce-scatters (alike in both modes);
  the root unit (projection, norm) is unsharded before the timed region. CP1
  (where the modes coincide) is the reference, in its own launch.
- ``--scope step``: one real ``Trainer.train_step`` (post-processing, forward,
  backward, clipping, optimizer) on a fresh copy of the row, carrying this
  rank's share of the images in sharded mode; before it, the Trainer's batch
  agreement check on the CPU row, timed on its own.

Per pair the slowest rank's time in each mode; the ratio is sharded over
replicated per pair, its median and quartiles. Every pass carries fixed costs
alike in both modes (FSDP's collectives, the Python dispatch of a few hundred
ops), so the ratio falls towards the share of images as their number grows.
On the CPU debug model the decoder dominates the step, so a step's gain is a
few percent of its vision part's.

    python benchmarks/vision_time.py --scope vision      # table + JSON
    python benchmarks/vision_time.py --scope step --seq-len 512 --cp 2 \\
        --images 1 4 --tokens-per-image 16 --pairs 2 --warmup 0
"""

import argparse
import time

import _harness  # benchmarks/, first on sys.path when run as a script
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

# scope -> its timed phases (the last one is compared) and its defaults.
SCOPES = {
    "vision": (
        ("forward_ms", "backward_ms", "total_ms"),
        dict(seq_len=8192, cp=[1, 2, 4], images=[64], tokens_per_image=64, pairs=7),
    ),
    "step": (
        ("agreement_ms", "step_ms"),
        dict(seq_len=2048, cp=[2, 4], images=[1, 64], tokens_per_image=16, pairs=5),
    ),
}


def _parse_args(argv=None) -> argparse.Namespace:
    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument("--scope", choices=SCOPES, default="vision")
    known, _ = scope.parse_known_args(argv)
    defaults = dict(SCOPES[known.scope][1])
    pairs = defaults.pop("pairs")
    parser = _harness.degree_parser(
        __doc__, **defaults, json=f"vision_time_{known.scope}.json"
    )
    parser.add_argument("--scope", choices=SCOPES, default="vision")
    parser.add_argument("--pairs", type=int, default=pairs)
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed passes per mode and images"
    )
    return _harness.parse_degrees(parser, argv)


# ---------------------------------------------------------------- worker side


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
        try:
            _harness.barrier()
            start = time.perf_counter()
            features = model._get_vision_features(
                extra["pixel_values"], extra["grid_thw"]
            )
            out_BLD = model._inject_vision(h_in_BLD, features, vision_mask_BL)
            _harness.synchronize(trainer)
            forward_end = time.perf_counter()
            out_BLD.backward(grad_BLD)
            _harness.synchronize(trainer)
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


def _vision_timer(trainer, modes: list[str], batch):
    """Each mode's model inputs (untimed), and a timer of one vision pass."""
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
    share = model_inputs[modes[-1]][2].get("cp_vision_share")
    images = len(batch[0]["grid_thw"])

    def timed(mode: str) -> dict[str, float]:
        return _vision_pass(trainer, model_inputs[mode], h0_BLD, grad_BLD)

    return timed, {"image_range": share.image_range if share else [0, images]}


def _step_timer(trainer, modes: list[str], batch):
    def timed(mode: str) -> dict[str, float]:
        return {
            "agreement_ms": _harness.batch_agreement(trainer, batch),
            "step_ms": train_step_in(trainer, mode, batch),
        }

    return timed, {}


def _measure(args: argparse.Namespace, trainer) -> list[dict]:
    modes = modes_at(trainer, args.vision)
    if args.scope == "vision":
        # One-time work (FSDP lazy init, optimizer state) stays out.
        warm_up = _harness.synthetic_batch(
            trainer, min(args.seq_len, 1024), 1, args.tokens_per_image
        )
        for mode in modes:
            train_step_in(trainer, mode, warm_up)
    timer = _vision_timer if args.scope == "vision" else _step_timer
    rows = []
    for images in args.images:
        batch = _harness.synthetic_batch(
            trainer, args.seq_len, images, args.tokens_per_image
        )
        timed, facts = timer(trainer, modes, batch)
        for _ in range(args.warmup):
            for mode in modes:
                timed(mode)
        times = time_in_pairs(trainer, modes, args.pairs, timed)
        rows.append({"images": images, **facts, "times": times})
    return rows


# ---------------------------------------------------------------- driver side


def _rows(args, per_cp: dict[int, list[list[dict]]]) -> list[dict]:
    phases, _ = SCOPES[args.scope]
    rows = [
        {
            "cp": cp,
            "images": rank_rows[0]["images"],
            "vision_tokens": rank_rows[0]["images"] * args.tokens_per_image,
            **compare_slowest_ranks([r["times"] for r in rank_rows], phases),
            "image_ranges": [r.get("image_range") for r in rank_rows],
            "ranks": rank_rows,
        }
        for cp, ranks in per_cp.items()
        for rank_rows in zip(*ranks, strict=True)
    ]
    base = {r["images"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        for mode in args.vision:
            if r["images"] in base and f"{mode}_{phases[-1]}" in r:
                reference = base[r["images"]][f"replicated_{phases[-1]}"]
                r[f"{mode}_vs_cp1"] = r[f"{mode}_{phases[-1]}"] / reference
    return rows


def _mode_cells(r: dict, mode: str, phases) -> list[str]:
    if f"{mode}_{phases[-1]}" not in r:
        return ["-"] * (len(phases) + 1)
    vs_cp1 = r.get(f"{mode}_vs_cp1")
    cells = [f"{r[f'{mode}_{phase}']:.1f}" for phase in phases]
    return cells + [f"{vs_cp1:.2f}x" if vs_cp1 is not None else "-"]


def _table(args, rows: list[dict]) -> str:
    phases, _ = SCOPES[args.scope]
    timed = phases if args.scope == "vision" else phases[-1:]
    columns = ["CP", "images", "vision tokens"]
    for mode in ("replicated", "sharded"):
        columns += [f"{mode} {phase.removesuffix('_ms')} ms" for phase in timed]
        columns.append("vs CP1")
    columns += ["sharded / replicated", "quartiles"]
    if args.scope == "step":
        columns += ["batch agreement ms", "% of step"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["images"], r["cp"])):
        row = [str(r["cp"]), str(r["images"]), str(r["vision_tokens"])]
        for mode in ("replicated", "sharded"):
            row += _mode_cells(r, mode, timed)
        row += ratio_cells(r)
        if args.scope == "step":
            agreement, step = r["replicated_agreement_ms"], r["replicated_step_ms"]
            row += [f"{agreement:.2f}", f"{100 * agreement / step:.3f}%"]
        cells.append(row)
    return _harness.table(columns, cells)


def _report(args, per_cp: dict[int, list[list[dict]]]) -> tuple[str, list[dict]]:
    rows = _rows(args, per_cp)
    header = (
        f"{args.scope} time: seq_len {args.seq_len}, {args.tokens_per_image} tokens "
        f"per image, fp32, {args.layers} decoder layers; times: median over "
        f"{args.pairs} pairs of the slowest rank's; sharded / replicated: median "
        "(and quartiles) of the alternated pairs' ratios"
    )
    return header + "\n" + _table(args, rows), rows


def main(argv=None) -> None:
    _harness.run_degrees(_parse_args(argv), _measure, _report)


if __name__ == "__main__":
    main()
