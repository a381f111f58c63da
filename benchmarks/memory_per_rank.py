"""Peak tensor memory per rank of one training step, CP1 vs CP2 vs CP4, by vision mode.

Each CP degree runs on its own gloo ranks (``_harness.run_degrees``: the
plug-in's Trainer of ``train_configs/packed.toml`` at that CP degree), one
``train_step`` per measurement on a synthetic row of ``--seq-len`` tokens
holding ``--images`` images of ``--tokens-per-image`` placeholders, spread
evenly, in every ``--vision`` mode (``_vision_modes.set_vision_mode`` switches
the built Trainer); ratios are against CP1 in the same mode (at CP1 the modes
coincide: measured once). Memory is allocated tensor storage, not RSS
(``_live_memory.LiveMemory``), by phase and region:

- decoder / vision activations: peak live bytes allocated in forward, without
  the attention kernel's scratch; total: their sum, on the worst rank;
- attention scratch: the CPU backend's eager flex kernel's [B, H, Lq, Lk] fp32
  scores, which a fused GPU kernel never stores (forward or backward peak);
- step peak: this rank's parameters and optimizer state plus the peak of
  everything the step allocated (scratch included);
- exchange (sharded): bytes its collectives move per rank
  (``_vision_modes.ExchangeBytes``), beside the activation bytes the mode
  saves. The exchange runs outside the vision modules, so its blocks and the
  bank count as decoder activations (replicated: the bank is vision's output).

    python benchmarks/memory_per_rank.py                  # table + JSON
    python benchmarks/memory_per_rank.py --seq-len 512 --cp 1 2 --images 1 4
"""

import argparse

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _harness import MIB
from _vision_modes import ExchangeBytes, modes_at, set_vision_mode, with_vision_share


def _parse_args(argv=None) -> argparse.Namespace:
    parser = _harness.degree_parser(
        __doc__,
        seq_len=8192,
        cp=[1, 2, 4],
        images=[1, 16, 64],
        json="memory_per_rank.json",
    )
    args = _harness.parse_degrees(parser, argv)
    if args.cp[0] != 1:
        parser.error(
            f"--cp must start with 1 (the baseline of the ratios); got {args.cp}"
        )
    return args


# ---------------------------------------------------------------- worker side


def _state_bytes(trainer) -> dict[str, int]:
    from _live_memory import storage_bytes

    params = [p for m in trainer.model_parts for p in m.parameters()]
    states = [
        v
        for optimizer in trainer.optimizers.optimizers
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": storage_bytes(states),
    }


def _measure_step(trainer, batch, vision_modules) -> dict:
    from _live_memory import LiveMemory
    from torchtitan.tools.utils import device_module

    from torchtitan_ext import cpu_backend

    tracker = LiveMemory(vision_modules)
    fwd_bwd = trainer.forward_backward_step
    batch = with_vision_share(trainer, batch)
    # CP sharding compiles create_block_mask, which no dispatch mode may watch:
    # the step's inputs are prepared (by the real hook) before it starts.
    prepared = trainer.post_dataloading_process(*batch)

    peak_rss = {}

    def fwd_bwd_as_forward(**kwargs):
        with tracker.in_phase("forward"):
            loss = fwd_bwd(**kwargs)
        # Read before the metrics logger resets the peak after the step.
        peak_rss["fwd_bwd"] = cpu_backend.peak_rss_bytes()
        return loss

    trainer.post_dataloading_process = lambda input_dict, labels: prepared
    trainer.forward_backward_step = fwd_bwd_as_forward
    trainer.step += 1
    device_module.reset_peak_memory_stats()
    try:
        with tracker, tracker.in_phase("step"), ExchangeBytes() as exchange:
            trainer.train_step(iter([batch]))
    finally:
        del trainer.post_dataloading_process, trainer.forward_backward_step
        tracker.remove_hooks()
    peak = dict(tracker.peak)
    return {
        "decoder_activation_bytes": peak.get("forward/decoder", 0),
        "vision_activation_bytes": peak.get("forward/vision", 0),
        **{
            f"{region}_attn_scratch_bytes": max(
                peak.get(f"{phase}/{region}/attn_scratch", 0)
                for phase in ("forward", "backward")
            )
            for region in ("decoder", "vision")
        },
        "backward_peak_bytes": {
            k: v for k, v in peak.items() if k.startswith("backward/")
        },
        "step_allocated_peak_bytes": tracker.peak_total,
        "at_step_peak_bytes": tracker.at_peak,
        "state_bytes": _state_bytes(trainer),
        "peak_rss_bytes": peak_rss["fwd_bwd"],
        **exchange.summary(),
    }


def _measure(args: argparse.Namespace, trainer) -> list[dict]:
    """Rows per (images, mode); at CP1 one measurement stands for every mode."""
    from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS

    model = trainer.model_parts[0]
    vision_modules = [getattr(model, fqn) for fqn in VISION_MODULE_FQNS]
    modes = modes_at(trainer, args.vision)
    # One-time allocations (FSDP lazy init, optimizer state) stay out.
    warm_up = _harness.synthetic_batch(
        trainer, min(args.seq_len, 1024), 1, args.tokens_per_image
    )
    for mode in modes:
        set_vision_mode(trainer, mode)
        _measure_step(trainer, warm_up, vision_modules)
    rows = []
    for images in args.images:
        batch = _harness.synthetic_batch(
            trainer, args.seq_len, images, args.tokens_per_image
        )
        measured = {}
        for mode in modes:
            set_vision_mode(trainer, mode)
            measured[mode] = _measure_step(trainer, batch, vision_modules)
        for mode in args.vision:
            row = measured.get(mode, measured[modes[0]])
            rows.append({"images": images, "vision": mode, **row})
    return rows


# ---------------------------------------------------------------- driver side


# Rank figures reported (in MiB) on the rank where each is largest.
_MOST = (
    *("vision_activation", "decoder_attn_scratch", "vision_attn_scratch"),
    *("peak_rss", "exchange_forward", "exchange_backward", "exchange_wire"),
)


def _row(args, cp: int, rank_rows: list[dict]) -> dict:
    """One (CP, images, mode): each figure on the rank where it is largest."""

    def most_mib(value) -> float:
        return max(map(value, rank_rows)) / MIB

    worst = max(rank_rows, key=lambda r: r["decoder_activation_bytes"])
    images, vision = rank_rows[0]["images"], rank_rows[0]["vision"]
    return {
        **dict(cp=cp, images=images, vision=vision),
        "vision_tokens": images * args.tokens_per_image,
        "decoder_activation_mib": worst["decoder_activation_bytes"] / MIB,
        **{f"{k}_mib": most_mib(lambda r, k=k: r[f"{k}_bytes"]) for k in _MOST},
        "total_activation_mib": most_mib(
            lambda r: r["decoder_activation_bytes"] + r["vision_activation_bytes"]
        ),
        "state_mib": sum(worst["state_bytes"].values()) / MIB,
        "step_peak_mib": most_mib(
            lambda r: (
                r["step_allocated_peak_bytes"]
                + r["state_bytes"]["params"]
                + r["state_bytes"]["optimizer"]
            )
        ),
        "ranks": rank_rows,
    }


def _rows(args, per_cp: dict[int, list[list[dict]]]) -> list[dict]:
    rows = [
        _row(args, cp, list(rank_rows))
        for cp, ranks in per_cp.items()
        for rank_rows in zip(*ranks, strict=True)
    ]
    base = {(r["images"], r["vision"]): r for r in rows if r["cp"] == 1}
    replicated = {
        (r["cp"], r["images"]): r for r in rows if r["vision"] == "replicated"
    }
    for r in rows:
        b = base[r["images"], r["vision"]]
        for name in ("decoder", "vision", "total"):
            r[f"{name}_ratio_vs_cp1"] = (
                r[f"{name}_activation_mib"] / b[f"{name}_activation_mib"]
            )
        r["vision_share"] = r["vision_activation_mib"] / (
            r["vision_activation_mib"] + r["decoder_activation_mib"]
        )
        rep = replicated.get((r["cp"], r["images"]))
        if r["vision"] == "sharded" and rep is not None:
            for name in ("vision", "total"):
                key = f"{name}_activation_mib"
                r[f"{name}_saved_mib"] = rep[key] - r[key]
    return rows


def _cells(r: dict) -> list[str]:
    cells = [str(r["cp"]), str(r["images"]), r["vision"], str(r["vision_tokens"])]
    for name in ("decoder", "vision", "total"):
        cells.append(f"{r[f'{name}_activation_mib']:.1f}")
        cells.append(f"{r[f'{name}_ratio_vs_cp1']:.2f}x")
    return [
        *cells,
        f"{100 * r['vision_share']:.0f}%",
        f"{r['decoder_attn_scratch_mib']:.0f} / {r['vision_attn_scratch_mib']:.0f}",
        f"{r['state_mib']:.1f}",
        f"{r['step_peak_mib']:.0f}",
        f"{r['peak_rss_mib']:.0f}",
    ]


def _report(args, per_cp: dict[int, list[list[dict]]]) -> tuple[str, list[dict]]:
    rows = _rows(args, per_cp)
    columns = [
        *("CP", "images", "vision", "vision tokens"),
        *("decoder act. MiB", "vs CP1", "vision act. MiB", "vs CP1"),
        *("total act. MiB", "vs CP1", "vision share", "attn scratch MiB (dec / vis)"),
        *("params+grads+opt MiB", "step peak MiB", "peak RSS MiB"),
    ]
    order = sorted(rows, key=lambda r: (r["images"], r["vision"], r["cp"]))
    text = _harness.table(columns, map(_cells, order), left=["vision"])
    if "sharded" not in args.vision or "replicated" not in args.vision:
        return text, rows
    # Sharded mode under CP: what the exchange moves beside what it saves.
    columns = [
        *("CP", "images", "all-gather out MiB (fwd)"),
        *("reduce-scatter in MiB (bwd, fp32)", "ring MiB sent per rank"),
        *("vision act. saved MiB per rank", "total act. saved MiB per rank"),
    ]
    mib = ("exchange_forward", "exchange_backward", "exchange_wire")
    mib += ("vision_saved", "total_saved")
    cells = [
        [str(r["cp"]), str(r["images"]), *(f"{r[f'{k}_mib']:.2f}" for k in mib)]
        for r in sorted(rows, key=lambda r: (r["images"], r["cp"]))
        if r["cp"] > 1 and "vision_saved_mib" in r
    ]
    text += "\n\nSharded vision: bytes exchanged vs activation bytes saved, per rank\n"
    return text + _harness.table(columns, cells), rows


def main(argv=None) -> None:
    _harness.run_degrees(_parse_args(argv), _measure, _report)


if __name__ == "__main__":
    main()
