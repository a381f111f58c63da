"""A job's step time on paper: a roofline, not a measurement.

FLOPs per rank (matmuls and attention, forward, backward and what activation
checkpointing recomputes) over an assumed achieved FLOP/s, and the bytes each
collective moves per rank over an assumed link bandwidth. Every assumption is a
field of ``Hardware`` (a command-line flag of the planner's decision verb):

- one document per row: causal attention over the whole row (global layers) or
  the window (sliding layers); every image within one vision window;
- TP's and CP's collectives wait on the critical path (torchtitan 0.3.0 runs no
  async TP, and a layer's attention needs its k/v all-gather first); FSDP's
  all-gather and reduce-scatter overlap the compute (prefetching);
- a collective over a ring that leaves a node runs at the network's per-GPU
  bandwidth; ranks are placed pp, dp, cp, tp from outermost to innermost;
- selective AC (torchtitan's policy) recomputes half the matmuls and every
  all-gather, full AC the whole forward of each block;
- 1F1B's bubble: ``(microbatches + pp - 1) / microbatches`` of a stage's time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["Hardware", "StepTime", "fixed_terms", "forward_flops", "step_time"]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100 and H200 SXM)
    efficiency: float = 0.5  # achieved / peak, matmuls and attention alike
    nvlink_gbps: float = 450.0  # GB/s per GPU and direction within a node
    network_gbps: float = 50.0  # GB/s per GPU across nodes (a 400 Gb/s NIC each)
    gpus_per_node: int = 8


def _causal_keys(seq_len: int, window: int | None) -> int:
    """Keys summed over a row's queries: causal, within ``window`` if set."""
    w = seq_len if window is None else min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def forward_flops(model, *, seq_len: int, images: int, tokens_per_image: int):
    """Forward FLOPs of one row by part, ``{part: (matmul, attention)}``: decoder
    (its layers), lm_head and, with images, vision (blocks and patch embedding)
    and adapter (with ``vision_projection``)."""
    layer0 = model.layers[0]
    a0 = layer0.attention
    q, kv = a0.n_heads * a0.head_dim, a0.n_kv_heads * a0.head_dim
    hidden = layer0.feed_forward.w1.out_features
    layer_matmul = 2 * seq_len * (2 * model.dim * q + 2 * model.dim * kv)
    layer_matmul += 2 * seq_len * 3 * model.dim * hidden
    attention = sum(
        4 * q * _causal_keys(seq_len, layer.attention.window_size)
        for layer in model.layers
    )
    flops = {
        "decoder": (len(model.layers) * layer_matmul, attention),
        "lm_head": (2 * seq_len * model.dim * model.vocab_size, 0),
    }
    encoder = model.vision_encoder
    if encoder is None or images == 0:
        return flops
    merge = encoder.downsample_factor**2
    patches = tokens_per_image * merge  # per image
    d, mlp = encoder.latent_dim, encoder.block.mlp.fc1.out_features
    block = 2 * patches * (4 * d * d + 2 * d * mlp)
    window = encoder.pos_emb_grid_h * encoder.pos_emb_grid_w
    keys = [patches] * encoder.num_layers  # global layers
    for i in range(encoder.num_layers):
        if (i + 1) % encoder.sparse_attention_factor and i != encoder.num_layers - 1:
            keys[i] = min(patches, window)
    patch_in = encoder.conv1.in_features * d
    linears = (model.vision_adapter.c_fc, model.vision_adapter.c_proj)
    projection = sum(x.in_features * x.out_features for x in linears)
    projection += model.vision_projection.in_features * model.dim
    flops["vision"] = (
        images * (encoder.num_layers * block + 2 * patches * patch_in),
        images * sum(4 * d * patches * k for k in keys),
    )
    flops["adapter"] = (images * 2 * tokens_per_image * projection, 0)
    return flops


@dataclass
class StepTime:
    """One rank's step: FLOPs and collective bytes, and the seconds they take."""

    flops: float
    bytes_sent: dict[str, float]  # per collective kind, per rank and step
    compute_s: float
    exposed_s: float  # TP, CP and PP transfers on the critical path
    overlapped_s: float  # FSDP's, hidden behind compute when shorter
    bubble: float  # 1F1B's factor
    seconds: float


def _ring(size: int, nbytes: float) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of ``nbytes``."""
    return (size - 1) / size * nbytes


def step_time(config, world_size: int, images: int, tokens_per_image: int, hw):
    """``config``'s step on ``world_size`` GPUs, ``images`` per row (see module)."""
    p, training = config.parallelism, config.training
    model, seq = config.model_spec.model, training.seq_len
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    pp = p.pipeline_parallel_degree
    fsdp = world_size // (tp * pp)  # dp_shard x cp: FSDP's group
    rows = training.local_batch_size
    microbatches = rows // p.pipeline_parallel_microbatch_size if pp > 1 else 1
    ac = type(config.activation_checkpoint).__qualname__.split(".")[0]
    recompute = {"FullAC": 1.0, "SelectiveAC": 0.5}.get(ac, 0.0)  # of the matmuls
    vision_cp = cp if p.context_parallel_vision == "sharded" else 1
    flops = 0.0
    parts = forward_flops(
        model, seq_len=seq, images=images, tokens_per_image=tokens_per_image
    )
    for part, (matmul, attention) in parts.items():
        redone = 0.0
        if part in ("decoder", "vision"):  # the blocks AC wraps
            redone = recompute * matmul + (attention if ac == "FullAC" else 0.0)
        share = tp * (vision_cp if part in ("vision", "adapter") else cp)
        flops += (3 * (matmul + attention) + redone) / share
    flops *= rows / pp

    # Collective bytes each rank sends per step; activations and parameters bf16.
    layers = len(model.layers) / pp
    sent = {}
    if tp > 1:  # SP, per layer: 2 all-gathers and 2 reduce-scatters of [S/cp, dim]
        calls = 8 + {"FullAC": 4, "SelectiveAC": 2}.get(ac, 0)  # fwd, bwd, redo
        sent["tp"] = rows * layers * calls * _ring(tp, seq / cp * model.dim * 2)
    if cp > 1:  # per layer: k and v all-gathered, their grads reduce-scattered
        a0 = model.layers[0].attention
        kv = 2 * seq * a0.n_kv_heads / tp * a0.head_dim * 2
        calls = 2 + (ac in ("FullAC", "SelectiveAC"))  # SAC saves no all-gather
        sent["cp"] = rows * layers * calls * _ring(cp, kv)
        if vision_cp > 1:  # the projected image rows, all-gathered, and back
            bank = images * tokens_per_image * model.dim * 2
            sent["cp"] += rows * 2 * _ring(cp, bank)
    if fsdp > 1:  # bf16 all-gathers (forward, backward), a float32 reduce-scatter
        params = sum(_parameters(config).values()) / (tp * pp)
        all_gathers = 1 if pp > 1 else 2  # under PP, kept unsharded after forward
        sent["fsdp"] = _ring(fsdp, params * (2 * all_gathers + 4))
    if pp > 1:  # each microbatch's stage output forward, its grad back
        sent["pp"] = rows * 2 * seq / cp * model.dim / tp * 2

    spans = {"tp": tp, "cp": cp * tp, "fsdp": fsdp * tp, "pp": world_size}
    within = {k: span <= hw.gpus_per_node for k, span in spans.items()}
    seconds = {
        kind: nbytes / 1e9 / (hw.nvlink_gbps if within[kind] else hw.network_gbps)
        for kind, nbytes in sent.items()
    }
    compute_s = flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    exposed_s = sum(t for kind, t in seconds.items() if kind != "fsdp")
    overlapped_s = seconds.get("fsdp", 0.0)
    bubble = (microbatches + pp - 1) / microbatches
    return StepTime(
        flops=flops,
        bytes_sent=sent,
        compute_s=compute_s,
        exposed_s=exposed_s,
        overlapped_s=overlapped_s,
        bubble=bubble,
        seconds=max(compute_s + exposed_s, overlapped_s) * bubble,
    )


def fixed_terms(config, images: int, tokens_per_image: int) -> dict[str, float]:
    """Bytes a rank holds that no CP degree shrinks, by paper count (one
    microbatch; bf16 activations and parameters for compute), each at its own
    moment: the vision encoder's while it runs, not at the step's peak."""
    p, model = config.parallelism, config.model_spec.model
    tp, pp = p.tensor_parallel_degree, p.pipeline_parallel_degree
    rows = p.pipeline_parallel_microbatch_size if pp > 1 else None
    rows = rows or config.training.local_batch_size
    ac = type(config.activation_checkpoint).__qualname__.split(".")[0]
    params = _parameters(config)
    a0 = model.layers[0].attention
    kv_layer = config.training.seq_len * 2 * a0.n_kv_heads / tp * a0.head_dim * 2
    sliding = sum(layer.attention.window_size is not None for layer in model.layers)
    kept = 1 if ac in ("FullAC", "SelectiveAC") else sliding / pp  # saved for bwd
    vision = params["vision_encoder"] / tp
    return {
        # Every CP rank holds every projected image row, and its gradient.
        "vision bank + grad": 2 * rows * images * tokens_per_image * model.dim * 2,
        # One FSDP unit: all-gathered whole, its grads whole until reduce-scattered.
        "vision encoder unsharded (params, grads, fp32 RS input)": vision * 8,
        # Whole-sequence k/v where the window needs the previous 2048 tokens.
        "sliding layers' all-gathered k/v": kept * kv_layer,
        # ChunkedLossWrapper keeps lm_head all-gathered across its chunks.
        "lm_head unsharded across loss chunks": params["lm_head"] / tp * 2,
        # Each layer's complex64 table covers the whole sequence on every CP rank.
        "RoPE tables": sum(layer.attention.rope is not None for layer in model.layers)
        * config.training.seq_len
        * (a0.rope.dim // 2)
        * 8,
    }


@functools.cache
def _parameters_of(flavor: str) -> dict[str, int]:
    import torch

    from torchtitan_ext.muse_glimmer import model_registry

    with torch.device("meta"):
        model = model_registry(flavor).model.build()
    return {
        name: sum(p.numel() for p in child.parameters())
        for name, child in model.named_children()
    }


def _parameters(config) -> dict[str, int]:
    """Parameter counts of the job's model by top-level module (built on meta)."""
    return _parameters_of(config.model_spec.flavor)
