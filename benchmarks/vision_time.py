"""Vision time or training step time per rank, sharded vs replicated CP vision.

Sharded vision should cut each CP rank's vision work to its share of the
images, at the price of one exchange of the projected rows, and must not slow
a step with few images. Each ``--cp`` degree runs on its own ranks
(``_harness.run_degrees``); per ``--images`` count each rank times one scope in
both modes, alternating in pairs, after untimed warm-up passes:

- ``--scope vision``: the vision path alone (encoder, adapter, projection,
  norm, the exchange, the gather into the embeddings), forward and backward
  from a fixed gradient, called as ``MuseGlimmerModel.forward`` calls it on
  the inputs post-processing gives this rank; FSDP as in training, the root
  unit unsharded before the timed region. CP1 is the reference.
- ``--scope step``: one real ``Trainer.train_step``, and before it the batch
  agreement check on the CPU row, timed on its own.

Per pair the slowest rank's time in each mode; the ratio is sharded over
replicated per pair, its median and quartiles.

    python benchmarks/vision_time.py --scope vision      # table + JSON
    python benchmarks/vision_time.py --scope step --seq-len 512 --cp 2 \\
        --images 1 4 --tokens-per-image 16 --pairs 2 --warmup 0
"""

import argparse
import functools
import statistics
import time

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _vision_modes import VISION_MODES, modes_at, set_vision_mode, with_vision_share

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
            torch.distributed.barrier()
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


def _train_step(trainer, mode: str, batch) -> float:
    """One ``Trainer.train_step`` in ``mode`` on a fresh copy of ``batch`` (ms)."""
    set_vision_mode(trainer, mode)
    return _harness.train_step(trainer, with_vision_share(trainer, batch))


def _timer(args, trainer, modes: list[str], batch):
    """A timer of the scope in a mode, and facts of this rank's row."""
    if args.scope == "step":

        def timed_step(mode: str) -> dict[str, float]:
            check = trainer.batch_agreement.check
            agreement_ms, _ = _harness.timed_ms(trainer, check, *batch, "the benchmark")
            return {
                "agreement_ms": agreement_ms,
                "step_ms": _train_step(trainer, mode, batch),
            }

        return timed_step, {}
    inputs = {}  # each mode's model inputs, untimed
    for mode in modes:
        set_vision_mode(trainer, mode)
        inputs[mode] = trainer.post_dataloading_process(
            *with_vision_share(trainer, batch)
        )
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
        warm_up = _harness.synthetic_batch(
            trainer, min(args.seq_len, 1024), 1, args.tokens_per_image
        )
        for mode in modes:
            _train_step(trainer, mode, warm_up)
    rows = []
    for images in args.images:
        batch = _harness.synthetic_batch(
            trainer, args.seq_len, images, args.tokens_per_image
        )
        timed, facts = _timer(args, trainer, modes, batch)
        for _ in range(args.warmup):
            for mode in modes:
                timed(mode)
        variants = {mode: functools.partial(timed, mode) for mode in modes}
        times = _harness.in_pairs(variants, args.pairs)
        rows.append({"images": images, **facts, "times": times})
    return rows


def _rows(args, per_cp: dict[int, list[list[dict]]]) -> list[dict]:
    """Per CP and images, each mode's median over pairs of the slowest rank's
    times, and sharded over replicated per pair of the last phase."""
    phases, _ = SCOPES[args.scope]
    total = phases[-1]
    rows = []
    for cp, ranks in per_cp.items():
        for rank_rows in zip(*ranks, strict=True):  # one images count, every rank
            images = rank_rows[0]["images"]
            row = {"cp": cp, "images": images}
            row["vision_tokens"] = images * args.tokens_per_image
            slowest = {
                (mode, phase): [
                    max(rank[phase] for rank in pair)
                    for pair in zip(*(r["times"][mode] for r in rank_rows), strict=True)
                ]
                for mode in rank_rows[0]["times"]
                for phase in phases
            }
            row |= {f"{m}_{p}": statistics.median(t) for (m, p), t in slowest.items()}
            if ("sharded", total) in slowest:
                row["sharded_ratio"], row["sharded_ratio_quartiles"] = (
                    _harness.median_pair_ratio(
                        slowest["sharded", total], slowest["replicated", total]
                    )
                )
            if "replicated_agreement_ms" in row:
                agreement_ms = row["replicated_agreement_ms"]
                row["agreement_pct_of_step"] = (
                    100 * agreement_ms / row[f"replicated_{total}"]
                )
            row["image_ranges"] = [r.get("image_range") for r in rank_rows]
            rows.append(row | {"ranks": rank_rows})
    base = {r["images"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        for mode in args.vision:
            if r["images"] in base and f"{mode}_{total}" in r:
                reference = base[r["images"]][f"replicated_{total}"]
                r[f"{mode}_vs_cp1"] = r[f"{mode}_{total}"] / reference
    return rows


def _cell(key: str, spec: str):
    """A column: ``row[key]`` (a list: its items) through ``spec``; "-" if none."""

    def cell(row: dict) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        return spec.format(*value) if isinstance(value, list) else spec.format(value)

    return cell


def _report(args, per_cp: dict[int, list[list[dict]]]) -> tuple[str, list[dict]]:
    rows = _rows(args, per_cp)
    phases, _ = SCOPES[args.scope]
    columns = [("CP", "{cp}"), ("images", "{images}")]
    columns.append(("vision tokens", "{vision_tokens}"))
    for mode in VISION_MODES:
        for phase in phases if args.scope == "vision" else phases[-1:]:
            title = f"{mode} {phase.removesuffix('_ms')} ms"
            columns.append((title, _cell(f"{mode}_{phase}", "{:.1f}")))
        columns.append(("vs CP1", _cell(f"{mode}_vs_cp1", "{:.2f}x")))
    columns.append(("sharded / replicated", _cell("sharded_ratio", "{:.2f}x")))
    columns.append(("quartiles", _cell("sharded_ratio_quartiles", "{:.2f}-{:.2f}x")))
    if args.scope == "step":
        columns.append(("batch agreement ms", "{replicated_agreement_ms:.2f}"))
        columns.append(("% of step", "{agreement_pct_of_step:.3f}%"))
    header = (
        f"{args.scope} time: seq_len {args.seq_len}, {args.tokens_per_image} tokens "
        f"per image, fp32, {args.layers} decoder layers; times: median over "
        f"{args.pairs} pairs of the slowest rank's; sharded / replicated: median "
        "(and quartiles) of the alternated pairs' ratios"
    )
    order = sorted(rows, key=lambda r: (r["images"], r["cp"]))
    return header + "\n" + _harness.row_table(columns, order), rows


def main(argv=None) -> None:
    _harness.run_degrees(_parse_args(argv), _measure, _report)


if __name__ == "__main__":
    main()
