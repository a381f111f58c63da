"""Vision injection: the plug-in's bank-index gather vs torchtitan's span loop.

Times the forward and the backward (from a fixed output gradient) of writing
``n`` images' feature rows into a ``[1, seq_len, dim]`` token-embedding tensor,
both ways, alternating the two in every repetition (and which goes first) so
that machine noise hits both alike:

- upstream: ``MuseGlimmerModel._inject_vision`` of torchtitan 0.3.0 (placeholder
  spans found with one ``.tolist()`` host sync, then one slice assignment per
  span);
- plug-in: ``gather_vision_rows`` (``torch.where(idx >= 0, bank[idx.clamp(0)],
  h)``: no host sync, autograd's own backward), given the bank indices the
  Trainer builds before CP sharding; building them is timed on its own
  (``index_ms``).

Beside the times, each side's peak of the tensor bytes its forward and
backward allocate (``_live_memory.LiveMemory``), outputs and gradients included.

Projection and norm are identities in both, so only the injection is timed;
both get a non-leaf copy of the embeddings, as the model's injection does.
Every image has ``--tokens-per-image`` placeholders, spread evenly over the
sequence with text between them.

    python benchmarks/vision_injection.py            # table + JSON
    python benchmarks/vision_injection.py --seq-len 256 --images 1 4 --dims 16
"""

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from _harness import MIB, alternating, median_pair_ratio, table  # benchmarks/ first
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


def _batch(seq_len: int, images: int, tokens_per_image: int):
    """Tokens ``[1, seq_len]`` with evenly spaced spans, and ``grid_thw``."""
    if images * tokens_per_image > seq_len:
        raise ValueError(
            f"{images} images x {tokens_per_image} tokens do not fit seq_len {seq_len}"
        )
    tokens_1L = torch.full((1, seq_len), 9, dtype=torch.long)
    stride = seq_len // images
    for image in range(images):
        start = image * stride
        tokens_1L[0, start : start + tokens_per_image] = IMAGE_ID
    side = int(round(tokens_per_image**0.5))
    if side * side != tokens_per_image:
        raise ValueError(f"--tokens-per-image must be a square, got {tokens_per_image}")
    grid_thw_N3 = torch.tensor([[1, side * MERGE, side * MERGE]] * images)
    return tokens_1L, grid_thw_N3


def _forward_backward(inject, h0_1LD, bank0_TD, grad_1LD, memory=None):
    """Run one injection: (forward ms, backward ms, (out, h grad, bank grad)).

    Under ``memory`` (a ``LiveMemory``) its forward and backward are counted."""
    h_1LD = h0_1LD.clone().requires_grad_()
    bank_TD = bank0_TD.clone().requires_grad_()
    # A non-leaf copy to write into, as the embedding output in the model.
    h_in_1LD = h_1LD.clone()
    with memory or contextlib.nullcontext():
        start = time.perf_counter()
        out_1LD = inject(h_in_1LD, bank_TD)
        forward_end = time.perf_counter()
        out_1LD.backward(grad_1LD)
        backward_end = time.perf_counter()
    forward_ms = (forward_end - start) * 1e3
    backward_ms = (backward_end - forward_end) * 1e3
    return forward_ms, backward_ms, (out_1LD, h_1LD.grad, bank_TD.grad)


def _measure(seq_len: int, dim: int, images: int, tokens_per_image: int, repeats: int):
    tokens_1L, grid_thw_N3 = _batch(seq_len, images, tokens_per_image)
    rows = images * tokens_per_image
    generator = torch.Generator().manual_seed(0)
    h0_1LD = torch.randn(1, seq_len, dim, generator=generator)
    bank0_TD = torch.randn(rows, dim, generator=generator)
    grad_1LD = torch.randn(1, seq_len, dim, generator=generator)
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
    peak_bytes = {}
    runs = {}
    for name, inject in sides.items():
        memory = LiveMemory()
        runs[name] = _forward_backward(inject, h0_1LD, bank0_TD, grad_1LD, memory)[2]
        peak_bytes[name] = memory.peak_total
    for name, run in runs.items():
        if not all(map(torch.equal, runs["upstream"], run)):
            raise AssertionError(
                f"{name} disagrees with upstream (values or gradients)"
            )
    phases = ("forward", "backward", "total")
    times = {name: {phase: [] for phase in phases} for name in sides}
    index_ms = []
    for names in alternating(list(sides), repeats):
        for name in names:
            forward_ms, backward_ms, _ = _forward_backward(
                sides[name], h0_1LD, bank0_TD, grad_1LD
            )
            run_ms = (forward_ms, backward_ms, forward_ms + backward_ms)
            for phase, ms in zip(phases, run_ms, strict=True):
                times[name][phase].append(ms)
        start = time.perf_counter()
        index()
        index_ms.append((time.perf_counter() - start) * 1e3)
    row = {"seq_len": seq_len, "dim": dim, "images": images, "vision_tokens": rows}
    for name, by_phase in times.items():
        row[f"{name}_ms"] = statistics.median(by_phase["total"])
        row[f"{name}_forward_ms"] = statistics.median(by_phase["forward"])
        row[f"{name}_backward_ms"] = statistics.median(by_phase["backward"])
        row[f"{name}_peak_bytes"] = peak_bytes[name]
    for phase, key in zip(
        phases, ("speedup_forward", "speedup_backward", "speedup"), strict=True
    ):
        row[key], row[f"{key}_quartiles"] = median_pair_ratio(
            times["upstream"][phase], times["plugin"][phase]
        )
    row["index_ms"] = statistics.median(index_ms)
    row["repeats"] = repeats
    return row


def _table(rows: list[dict]) -> str:
    columns = [
        *("dim", "images", "vision tokens"),
        *(f"{side} fwd / bwd ms" for side in ("upstream", "plug-in")),
        *("speedup fwd", "speedup bwd", "speedup fwd+bwd", "quartiles"),
        "index build ms",
        *(f"{side} peak MiB" for side in ("upstream", "plug-in")),
    ]
    cells = []
    for r in rows:
        low, high = r["speedup_quartiles"]
        sides = ("upstream", "plugin")
        cells.append(
            [
                *(str(r["dim"]), str(r["images"]), str(r["vision_tokens"])),
                *(
                    f"{r[f'{s}_forward_ms']:.2f} / {r[f'{s}_backward_ms']:.2f}"
                    for s in sides
                ),
                *(f"{r[k]:.2f}x" for k in ("speedup_forward", "speedup_backward")),
                f"{r['speedup']:.2f}x",
                f"{low:.2f}-{high:.2f}x",
                f"{r['index_ms']:.2f}",
                *(f"{r[f'{s}_peak_bytes'] / MIB:.1f}" for s in sides),
            ]
        )
    return table(columns, cells)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--images", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--dims", type=int, nargs="+", default=list(DIMS.values()))
    parser.add_argument("--tokens-per-image", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--json", type=Path, default=Path("outputs/benchmarks/vision_injection.json")
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        _measure(args.seq_len, dim, images, args.tokens_per_image, args.repeats)
        for dim in args.dims
        for images in args.images
    ]
    print(
        f"seq_len {args.seq_len}, {args.tokens_per_image} tokens per image, fp32, "
        f"median of {args.repeats}, {args.threads} thread(s); speedup: median (and "
        "quartiles) of the back-to-back pairs' time ratios"
    )
    print(_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2
        )
        + "\n"
    )
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
