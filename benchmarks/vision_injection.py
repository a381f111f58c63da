"""Vision injection: the plug-in's bank-index gather vs torchtitan's span loop.

Times forward + backward of writing ``n`` images' feature rows into a
``[1, seq_len, dim]`` token-embedding tensor, both ways, alternating the two
in every repetition (and which goes first) so that machine noise hits both
alike:

- upstream: ``MuseGlimmerModel._inject_vision`` of torchtitan 0.3.0 (placeholder
  spans found with one ``.tolist()`` host sync, then one slice assignment per
  span);
- plug-in: ``gather_vision_rows`` (one indexed write of the bank rows, no
  host sync), given the bank indices the Trainer builds before CP sharding;
  building them is timed on its own (``index_ms``).

Projection and norm are identities in both, so only the injection is timed;
both get a non-leaf copy of the embeddings, as the model's injection does.
Every image has ``--tokens-per-image`` placeholders, spread evenly over the
sequence with text between them.

    python benchmarks/vision_injection.py            # table + JSON
    python benchmarks/vision_injection.py --seq-len 256 --images 1 4 --dims 16
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from torchtitan_ext import cpu_backend

cpu_backend.apply()

from torchtitan.models.muse_glimmer.model import (  # noqa: E402
    MuseGlimmerModel as UpstreamModel,
)

from torchtitan_ext.muse_glimmer import (  # noqa: E402
    build_vision_bank_indices,
    gather_vision_rows,
)

IMAGE_ID = 4
MERGE = 2
DIMS = {"debugmodel_mm": 256, "30B_mm": 6656}


class UpstreamInjection(nn.Module):
    """torchtitan's ``_inject_vision`` on just what it reads of its model.

    Projection and norm are identities, so only the injection runs; the tests
    compare the plug-in's gather with it too.
    """

    _vision_spans = UpstreamModel._vision_spans
    _inject_vision = UpstreamModel._inject_vision

    def __init__(self) -> None:
        super().__init__()
        self.vision_projection = nn.Identity()
        self.perception_emb_norm = nn.Identity()


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


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _measure(seq_len: int, dim: int, images: int, tokens_per_image: int, repeats: int):
    tokens_1L, grid_thw_N3 = _batch(seq_len, images, tokens_per_image)
    rows = images * tokens_per_image
    generator = torch.Generator().manual_seed(0)
    h0_1LD = torch.randn(1, seq_len, dim, generator=generator)
    bank0_TD = torch.randn(rows, dim, generator=generator)
    weight_1LD = torch.randn(1, seq_len, dim, generator=generator)
    vision_mask_1L = tokens_1L == IMAGE_ID
    upstream = UpstreamInjection()

    def index():
        return build_vision_bank_indices(
            tokens_1L, grid_thw_N3, image_id=IMAGE_ID, spatial_merge_size=MERGE
        )

    bank_indices_1L = index()

    def run_upstream():
        h_1LD = h0_1LD.clone().requires_grad_()
        bank_TD = bank0_TD.clone().requires_grad_()
        out = upstream._inject_vision(
            h_1LD.clone(), bank_TD.unsqueeze(0), vision_mask_1L
        )  # writes in place, as into the embedding output in the model
        (out * weight_1LD).sum().backward()
        return out, h_1LD.grad, bank_TD.grad

    def run_plugin():
        h_1LD = h0_1LD.clone().requires_grad_()
        bank_TD = bank0_TD.clone().requires_grad_()
        out = gather_vision_rows(h_1LD.clone(), bank_TD, bank_indices_1L)
        (out * weight_1LD).sum().backward()
        return out, h_1LD.grad, bank_TD.grad

    if not all(map(torch.equal, run_upstream(), run_plugin())):
        raise AssertionError("the two injections disagree (values or gradients)")
    times: dict[str, list[float]] = {"upstream": [], "plugin": [], "index": []}
    sides = [("upstream", run_upstream), ("plugin", run_plugin)]
    for repeat in range(repeats):
        for name, fn in sides[:: 1 if repeat % 2 == 0 else -1]:
            times[name].append(_timed(fn))
        times["index"].append(_timed(index))
    medians = {name: statistics.median(values) for name, values in times.items()}
    # Each repetition runs both sides back to back: their ratio shares the noise.
    ratios = [u / p for u, p in zip(times["upstream"], times["plugin"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if repeats > 1 else ratios * 3
    return {
        "seq_len": seq_len,
        "dim": dim,
        "images": images,
        "vision_tokens": rows,
        "upstream_ms": medians["upstream"],
        "plugin_ms": medians["plugin"],
        "index_ms": medians["index"],
        "speedup": statistics.median(ratios),
        "speedup_quartiles": [quartiles[0], quartiles[2]],
        "repeats": repeats,
    }


def _table(rows: list[dict]) -> str:
    lines = [
        "| dim | images | vision tokens | upstream ms | plug-in ms | speedup | "
        "speedup quartiles | index build ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        low, high = r["speedup_quartiles"]
        lines.append(
            f"| {r['dim']} | {r['images']} | {r['vision_tokens']} | "
            f"{r['upstream_ms']:.2f} | {r['plugin_ms']:.2f} | {r['speedup']:.2f}x | "
            f"{low:.2f}-{high:.2f}x | {r['index_ms']:.2f} |"
        )
    return "\n".join(lines)


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
        f"forward+backward, median of {args.repeats}, {args.threads} thread(s); "
        "speedup: median (and quartiles) of the back-to-back pairs' time ratios"
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
