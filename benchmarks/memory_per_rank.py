"""Peak tensor memory per rank of one training step, CP1 vs CP2 vs CP4, by vision mode.

Each CP degree runs on its own gloo ranks with the real stack
(``_harness.run_degrees``: the plug-in's ``MuseGlimmerTrainer`` of
``train_configs/packed.toml`` at ``--parallelism.context_parallel_degree N``),
and one ``train_step`` (forward, backward, optimizer) per measurement on
a synthetic row of ``--seq-len`` tokens holding ``--images`` images of
``--tokens-per-image`` placeholders each, spread evenly.

Each launch measures every ``--vision`` mode (``parallelism.context_parallel_vision``:
``replicated``, every CP rank encodes all images; ``sharded``, each encodes a
cost-balanced share and the ranks exchange the projected rows), switching the
built Trainer between them (``_vision_modes.set_vision_mode``: with the
spmd_types backend and no type checking the two attributes it sets are the
whole difference). A batch gets its share of the images through the Trainer's
``batch_generator``, as in training. Rows are per (CP, images, mode), ratios
against CP1 in the same mode; at CP1 the modes coincide (no share without CP),
so CP1 is measured once and stands for both.

Memory is *allocated tensor storage*, not RSS: ``_live_memory.LiveMemory``
(a ``TorchDispatchMode``) counts every storage an op creates until it dies,
filed by phase and region (vision modules ``VISION_MODULE_FQNS`` or decoder):

- decoder / vision activations: peak live bytes allocated in forward (the
  activations saved for backward, plus forward temporaries), without the
  attention kernel's scratch; total: their sum, on the rank where it is largest;
- attention scratch: the eager dense flex kernel of the CPU backend builds
  [B, H, Lq, Lk] fp32 score matrices (GiBs at 8192 tokens) that a fused GPU
  kernel never stores; peak over forward and backward, its own column;
- step peak: parameters, gradients and optimizer state (this rank's shards)
  plus the peak of everything the step allocated (scratch included);
- exchange (sharded): the bytes its collectives move per rank
  (``_vision_modes.ExchangeBytes``: the forward all-gather's output, the
  backward float32 reduce-scatter's input, and what a ring sends per rank),
  beside the vision activation bytes the mode saves per rank. The exchange runs
  in the model's ``_inject_vision``, outside the vision modules, so its padded
  block, the gathered blocks and the whole bank count as *decoder* activations
  (in replicated mode the bank is the vision norm's output: vision).

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
    def nbytes(tensors) -> int:
        storages = {}
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            storages[local.untyped_storage()._cdata] = local.untyped_storage().nbytes()
        return sum(storages.values())

    params = [p for m in trainer.model_parts for p in m.parameters()]
    states = [
        v
        for optimizer in trainer.optimizers.optimizers
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    return {
        "params": nbytes(params),
        "grads": nbytes([p.grad for p in params if p.grad is not None]),
        "optimizer": nbytes(states),
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
    scratch = {
        region: max(
            peak.get(f"{phase}/{region}/attn_scratch", 0)
            for phase in ("forward", "backward")
        )
        for region in ("decoder", "vision")
    }
    return {
        "decoder_activation_bytes": peak.get("forward/decoder", 0),
        "vision_activation_bytes": peak.get("forward/vision", 0),
        "decoder_attn_scratch_bytes": scratch["decoder"],
        "vision_attn_scratch_bytes": scratch["vision"],
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


def _row(args, cp: int, rank_rows: list[dict]) -> dict:
    """One (CP, images, mode): each figure on the rank where it is largest."""

    def most_mib(value) -> float:
        return max(value(r) for r in rank_rows) / MIB

    worst = max(rank_rows, key=lambda r: r["decoder_activation_bytes"])
    return {
        "cp": cp,
        "images": rank_rows[0]["images"],
        "vision": rank_rows[0]["vision"],
        "vision_tokens": rank_rows[0]["images"] * args.tokens_per_image,
        "decoder_activation_mib": worst["decoder_activation_bytes"] / MIB,
        "vision_activation_mib": most_mib(lambda r: r["vision_activation_bytes"]),
        "total_activation_mib": most_mib(
            lambda r: r["decoder_activation_bytes"] + r["vision_activation_bytes"]
        ),
        "decoder_attn_scratch_mib": most_mib(lambda r: r["decoder_attn_scratch_bytes"]),
        "vision_attn_scratch_mib": most_mib(lambda r: r["vision_attn_scratch_bytes"]),
        "state_mib": sum(worst["state_bytes"].values()) / MIB,
        "step_peak_mib": most_mib(
            lambda r: (
                r["step_allocated_peak_bytes"]
                + r["state_bytes"]["params"]
                + r["state_bytes"]["optimizer"]
            )
        ),
        "peak_rss_mib": most_mib(lambda r: r["peak_rss_bytes"]),
        "exchange_forward_mib": most_mib(lambda r: r["exchange_forward_bytes"]),
        "exchange_backward_mib": most_mib(lambda r: r["exchange_backward_bytes"]),
        "exchange_wire_mib": most_mib(lambda r: r["exchange_wire_bytes"]),
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
            r["vision_saved_mib"] = (
                rep["vision_activation_mib"] - r["vision_activation_mib"]
            )
            r["total_saved_mib"] = (
                rep["total_activation_mib"] - r["total_activation_mib"]
            )
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


def _table(rows: list[dict]) -> str:
    columns = [
        *("CP", "images", "vision", "vision tokens"),
        *("decoder act. MiB", "vs CP1", "vision act. MiB", "vs CP1"),
        *("total act. MiB", "vs CP1", "vision share", "attn scratch MiB (dec / vis)"),
        *("params+grads+opt MiB", "step peak MiB", "peak RSS MiB"),
    ]
    order = sorted(rows, key=lambda r: (r["images"], r["vision"], r["cp"]))
    return _harness.table(columns, map(_cells, order), left=["vision"])


def _exchange_table(rows: list[dict]) -> str:
    """Sharded mode under CP: what the exchange moves beside what it saves."""
    columns = [
        *("CP", "images", "all-gather out MiB (fwd)"),
        *("reduce-scatter in MiB (bwd, fp32)", "ring MiB sent per rank"),
        *("vision act. saved MiB per rank", "total act. saved MiB per rank"),
    ]
    cells = [
        (
            *(str(r["cp"]), str(r["images"])),
            *(f"{r['exchange_forward_mib']:.2f}", f"{r['exchange_backward_mib']:.2f}"),
            f"{r['exchange_wire_mib']:.2f}",
            *(f"{r['vision_saved_mib']:.2f}", f"{r['total_saved_mib']:.2f}"),
        )
        for r in sorted(rows, key=lambda r: (r["images"], r["cp"]))
        if r["cp"] > 1 and "vision_saved_mib" in r
    ]
    return _harness.table(columns, cells)


def _report(args, per_cp: dict[int, list[list[dict]]]) -> tuple[str, list[dict]]:
    rows = _rows(args, per_cp)
    text = _table(rows)
    if "sharded" in args.vision and "replicated" in args.vision:
        text += (
            "\n\nSharded vision: bytes exchanged vs activation bytes saved, per rank"
        )
        text += "\n" + _exchange_table(rows)
    return text, rows


def main(argv=None) -> None:
    _harness.run_degrees(_parse_args(argv), _measure, _report)


if __name__ == "__main__":
    main()
