"""Vision injection: the plug-in's bank-index gather vs torchtitan's span loop.

Forward and backward (from a fixed gradient) of writing ``n`` images' rows into
a ``[1, seq_len, dim]`` embedding, alternating the two in pairs: torchtitan
0.3.0's ``_inject_vision`` (one ``.tolist()`` host sync, one slice assignment
per span) against ``gather_vision_rows`` on the Trainer's bank indices (no
host sync, autograd's own backward; building the indices is timed apart).
Also each side's peak of tensor bytes allocated (``_live_memory.LiveMemory``).
Projection and norm are identities; both write into a non-leaf copy.

    python benchmarks/vision_injection.py            # table + JSON
    python benchmarks/vision_injection.py --seq-len 256 --images 1 4 --dims 16
"""

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from _harness import MIB, OUTPUTS, in_pairs, median_pair_ratio, row_table, write_json
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
PHASES = {"forward": "_forward", "backward": "_backward", "total": ""}  # key tags
_COLUMNS = [
    ("dim", "{dim}"),
    ("images", "{images}"),
    ("vision tokens", "{vision_tokens}"),
    ("upstream fwd / bwd ms", "{upstream_forward_ms:.2f} / {upstream_backward_ms:.2f}"),
    ("plug-in fwd / bwd ms", "{plugin_forward_ms:.2f} / {plugin_backward_ms:.2f}"),
    ("speedup fwd", "{speedup_forward:.2f}x"),
    ("speedup bwd", "{speedup_backward:.2f}x"),
    ("speedup fwd+bwd", "{speedup:.2f}x"),
    ("quartiles", "{speedup_quartiles[0]:.2f}-{speedup_quartiles[1]:.2f}x"),
    ("index build ms", "{index_ms:.2f}"),
    ("upstream peak MiB", lambda r: f"{r['upstream_peak_bytes'] / MIB:.1f}"),
    ("plug-in peak MiB", lambda r: f"{r['plugin_peak_bytes'] / MIB:.1f}"),
]


def _batch(seq_len: int, images: int, tokens_per_image: int):
    """Tokens ``[1, seq_len]`` with evenly spaced spans, and ``grid_thw``."""
    if images * tokens_per_image > seq_len:
        raise ValueError(
            f"{images} images x {tokens_per_image} tokens do not fit seq_len {seq_len}"
        )
    side = round(tokens_per_image**0.5)
    if side * side != tokens_per_image:
        raise ValueError(f"--tokens-per-image must be a square, got {tokens_per_image}")
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
        start = time.perf_counter()
        out_1LD = inject(h_in_1LD, bank_TD)
        forward_end = time.perf_counter()
        out_1LD.backward(grad_1LD)
        end = time.perf_counter()
    ms = (forward_end - start, end - forward_end, end - start)
    times = {phase: t * 1e3 for phase, t in zip(PHASES, ms, strict=True)}
    return times, (out_1LD, h_1LD.grad, bank_TD.grad)


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

    def index():
        return build_vision_bank_indices(
            tokens_1L, grid_thw_N3, image_id=IMAGE_ID, spatial_merge_size=MERGE
        )

    bank_indices_1L = index()
    sides = {
        "upstream": lambda h, bank: upstream._inject_vision(
            h, bank.unsqueeze(0), vision_mask_1L
        ),
        "plugin": lambda h, bank: gather_vision_rows(h, bank, bank_indices_1L),
    }
    row = {"seq_len": args.seq_len, "dim": dim, "images": images}
    row |= {"vision_tokens": rows, "repeats": args.repeats}
    outputs = {}
    for name, inject in sides.items():
        memory = LiveMemory()
        outputs[name] = _forward_backward(inject, tensors, memory)[1]
        row[f"{name}_peak_bytes"] = memory.peak_total
        if not all(map(torch.equal, outputs["upstream"], outputs[name])):
            raise AssertionError(
                f"{name} disagrees with upstream (values or gradients)"
            )
    runs = in_pairs(
        {
            name: lambda inject=inject: _forward_backward(inject, tensors)[0]
            for name, inject in sides.items()
        },
        args.repeats,
    )
    times = {name: {p: [r[p] for r in runs[name]] for p in PHASES} for name in sides}
    index_ms = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        index()
        index_ms.append((time.perf_counter() - start) * 1e3)
    for phase, tag in PHASES.items():
        for name in sides:
            row[f"{name}{tag}_ms"] = statistics.median(times[name][phase])
        row[f"speedup{tag}"], row[f"speedup{tag}_quartiles"] = median_pair_ratio(
            times["upstream"][phase], times["plugin"][phase]
        )
    row["index_ms"] = statistics.median(index_ms)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--images", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--dims", type=int, nargs="+", default=list(DIMS.values()))
    parser.add_argument("--tokens-per-image", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=OUTPUTS / "vision_injection.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [_measure(args, dim, images) for dim in args.dims for images in args.images]
    print(
        f"seq_len {args.seq_len}, {args.tokens_per_image} tokens per image, fp32, "
        f"median of {args.repeats}, {args.threads} thread(s); speedup: median (and "
        "quartiles) of the back-to-back pairs' time ratios"
    )
    print(row_table(_COLUMNS, rows))
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
