"""Vision injection: the plug-in's bank-index gather vs torchtitan's span loop.

Forward and backward (from a fixed gradient) of writing images' rows into a
``[1, seq_len, dim]`` embedding, alternated in pairs: torchtitan 0.3.0's
``_inject_vision`` (a ``.tolist()`` host sync, a slice assignment per span)
against ``gather_vision_rows`` on bank indices (no host sync, autograd's own
backward), and each side's peak tensor bytes (``_live_memory.LiveMemory``).
Projection and norm are identities.

    python benchmarks/vision_injection.py            # table + JSON
    python benchmarks/vision_injection.py --seq-len 256 --images 1 4 --dims 16
"""

import contextlib
import functools
import statistics

import _harness
import torch
from _harness import MIB
from _live_memory import LiveMemory

from torchtitan_ext import cpu_backend

cpu_backend.apply()

from torchtitan_ext.muse_glimmer import (  # noqa: E402
    build_vision_bank_indices,
    gather_vision_rows,
)
from torchtitan_ext.tools.upstream_injection import UpstreamInjection  # noqa: E402

IMAGE_ID = 4
MERGE = 2
DIMS = {"debugmodel_mm": 256, "30B_mm": 6656}
_COLUMNS = [
    ("dim", "{dim}"),
    ("images", "{images}"),
    ("vision tokens", "{vision_tokens}"),
    ("upstream fwd / bwd ms", "{upstream_forward_ms:.2f} / {upstream_backward_ms:.2f}"),
    ("plug-in fwd / bwd ms", "{plugin_forward_ms:.2f} / {plugin_backward_ms:.2f}"),
    ("speedup fwd+bwd", "{speedup:.2f}x"),
    ("quartiles", "{speedup_quartiles[0]:.2f}-{speedup_quartiles[1]:.2f}x"),
    ("upstream peak MiB", lambda r: f"{r['upstream_peak_bytes'] / MIB:.1f}"),
    ("plug-in peak MiB", lambda r: f"{r['plugin_peak_bytes'] / MIB:.1f}"),
]


def _batch(seq_len: int, images: int, tokens_per_image: int):
    """Tokens ``[1, seq_len]`` with evenly spaced spans, and ``grid_thw``."""
    side = round(tokens_per_image**0.5)
    tokens_1L = torch.full((1, seq_len), 9, dtype=torch.long)
    stride = seq_len // images
    for image in range(images):
        start = image * stride
        tokens_1L[0, start : start + tokens_per_image] = IMAGE_ID
    return tokens_1L, torch.tensor([[1, side * MERGE, side * MERGE]] * images)


def _forward_backward(inject, tensors, memory=None):
    """One injection: its ms per phase, and (out, h grad, bank grad); under
    ``memory`` (a ``LiveMemory``) its forward and backward are counted."""
    h0_1LD, bank0_TD, grad_1LD = tensors
    h_1LD = h0_1LD.clone().requires_grad_()
    bank_TD = bank0_TD.clone().requires_grad_()
    h_in_1LD = h_1LD.clone()  # a non-leaf to write into, as in the model
    with memory or contextlib.nullcontext():
        forward = functools.partial(inject, h_in_1LD, bank_TD)
        ms, out_1LD = _harness.forward_backward_ms(forward, grad_1LD)
    return ms, (out_1LD, h_1LD.grad, bank_TD.grad)


def _measure(args, dim: int, images: int) -> dict:
    tokens_1L, grid_thw_N3 = _batch(args.seq_len, images, args.tokens_per_image)
    rows = images * args.tokens_per_image
    generator = torch.Generator().manual_seed(0)
    tensors = [  # h0_1LD, bank0_TD, grad_1LD
        torch.randn(*shape, generator=generator)
        for shape in ((1, args.seq_len, dim), (rows, dim), (1, args.seq_len, dim))
    ]
    vision_mask_1L = tokens_1L == IMAGE_ID
    upstream = UpstreamInjection()
    bank_indices_1L = build_vision_bank_indices(
        tokens_1L, grid_thw_N3, image_id=IMAGE_ID, spatial_merge_size=MERGE
    )
    sides = {
        "upstream": lambda h, bank: upstream._inject_vision(
            h, bank.unsqueeze(0), vision_mask_1L
        ),
        "plugin": lambda h, bank: gather_vision_rows(h, bank, bank_indices_1L),
    }
    row = {"seq_len": args.seq_len, "dim": dim, "images": images, "vision_tokens": rows}
    outputs = {}
    for name, inject in sides.items():
        memory = LiveMemory()
        outputs[name] = _forward_backward(inject, tensors, memory)[1]
        row[f"{name}_peak_bytes"] = memory.peak_total
        if not all(map(torch.equal, outputs["upstream"], outputs[name])):
            raise AssertionError(
                f"{name} disagrees with upstream (values or gradients)"
            )
    variants = {
        name: lambda inject=inject: _forward_backward(inject, tensors)[0]
        for name, inject in sides.items()
    }
    runs = _harness.in_pairs(variants, args.repeats)
    for name, side_runs in runs.items():
        for phase in ("forward_ms", "backward_ms", "total_ms"):
            key = f"{name}_ms" if phase == "total_ms" else f"{name}_{phase}"
            row[key] = statistics.median(run[phase] for run in side_runs)
    totals = ([run["total_ms"] for run in runs[n]] for n in ("upstream", "plugin"))
    row["speedup"], row["speedup_quartiles"] = _harness.median_pair_ratio(*totals)
    return row


def main(argv: list[str] | None = None) -> None:
    row = dict(seq_len=8192, images=[1, 16, 64, 256], tokens=16)
    parser = _harness.row_parser(__doc__, **row, json="vision_injection.json")
    parser.add_argument("--dims", type=int, nargs="+", default=list(DIMS.values()))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = _harness.parse_row(parser, argv)
    torch.set_num_threads(args.threads)
    rows = [_measure(args, dim, images) for dim in args.dims for images in args.images]
    print(
        f"seq_len {args.seq_len}, {args.tokens_per_image} tokens per image, fp32, "
        f"median of {args.repeats}, {args.threads} thread(s); speedup: median (and "
        "quartiles) of the back-to-back pairs' time ratios"
    )
    print(_harness.table(_COLUMNS, rows))
    _harness.write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
