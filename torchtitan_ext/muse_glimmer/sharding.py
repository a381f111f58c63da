"""Sharding of muse_glimmer's vision path on the cp mesh axis, and its spmd types.

Upstream's vision layouts name only dp and tp, so FSDP, which shards over
(dp_shard, cp), finds plain tensors on the cp axis and refuses to wrap them.
Under CP the whole vision stack runs replicated: every CP rank of a DP group
encodes the same images, so every vision parameter and activation is ``R`` on
cp, and each rank's gradient is a partial sum (``P``) that FSDP's reduction
over (dp_shard, cp) completes. With sharded vision
(``parallelism.context_parallel_vision = "sharded"``) each CP rank encodes its
own share of the images: the parameters stay ``R`` on cp, the activations are
``V``, until the exchange all-gathers the projected rows into the ``R`` bank.
That region runs with cp as a local axis, as upstream runs it with dp
(``model.cp_local_vision_context``): a ``V`` activation has no global layout.
"""

import dataclasses

import spmd_types as spmd
from torchtitan.distributed.parallel_dims import MeshAxisName
from torchtitan.models.common.vision_encoder import VisionAttention
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import LocalMapConfig, ShardingConfig, SpmdLayout

__all__ = [
    "BANK_TYPE",
    "BATCH_TOKEN_TYPE",
    "TOKEN_TYPE",
    "SHARDED_VISION_INPUT_TYPE",
    "VISION_INPUT_TYPE",
    "VISION_MODULE_FQNS",
    "set_cp_vision_sharding_config",
]

DP = MeshAxisName.DP
CP = MeshAxisName.CP
TP = MeshAxisName.TP

VISION_MODULE_FQNS = (
    "vision_encoder",
    "vision_adapter",
    "vision_projection",
    "perception_emb_norm",
)
"""The multimodal embedding modules (data-flow order): they feed ``tok_embeddings``."""

# The Trainer's batch: split over dp, CP-sharded along the sequence.
BATCH_TOKEN_TYPE = {DP: spmd.S(0), CP: spmd.S(1), TP: spmd.R}
# Inside ``multimodal_context`` dp is a local axis: each DP rank encodes its own
# images (V), every CP rank of a DP group encodes the same ones (R).
VISION_INPUT_TYPE = {DP: spmd.V, CP: spmd.R, TP: spmd.I}
# Sharded vision: each CP rank encodes its own images.
SHARDED_VISION_INPUT_TYPE = {DP: spmd.V, CP: spmd.V, TP: spmd.I}
BANK_TYPE = {DP: spmd.V, CP: spmd.R, TP: spmd.R}
TOKEN_TYPE = {DP: spmd.V, CP: spmd.S(1), TP: spmd.R}


def _on_cp(layout: SpmdLayout | None, cp_type) -> SpmdLayout | None:
    if layout is None or CP in layout.axis_types:
        return layout
    # Mesh axes are looked up in the mesh's own order: dp, cp, tp.
    axis_types = {
        axis: layout.axis_types[axis] for axis in (DP,) if axis in layout.axis_types
    }
    axis_types[CP] = cp_type
    axis_types.update(layout.axis_types)
    return SpmdLayout(axis_types, partition_spec=layout.partition_spec)


def _grad_type(activation_type):
    """The gradient type of an activation: ``P`` for ``R``, ``V`` for ``V``."""
    return spmd.P if activation_type is spmd.R else activation_type


def _on_cp_everywhere(
    sharding: ShardingConfig, activation_type=spmd.R
) -> ShardingConfig:
    """The same layouts with cp added wherever it is missing.

    Parameters get ``R``; inputs and outputs ``activation_type`` (``R`` when
    every CP rank encodes the same images, ``V`` when each encodes its own).
    """

    def each(layouts, cp_type=activation_type):
        if layouts is None:
            return None
        if isinstance(layouts, dict):
            return {name: _on_cp(layout, cp_type) for name, layout in layouts.items()}
        if isinstance(layouts, tuple):
            return tuple(_on_cp(layout, cp_type) for layout in layouts)
        return _on_cp(layouts, cp_type)

    local_map = sharding.local_map
    if local_map is not None:
        local_map = LocalMapConfig(
            in_grad_placements=each(
                local_map.in_grad_placements, _grad_type(activation_type)
            )
        )
    return ShardingConfig(
        state_shardings=each(sharding.state_shardings, spmd.R),
        in_src_shardings=each(sharding.in_src_shardings),
        in_dst_shardings=each(sharding.in_dst_shardings),
        out_src_shardings=each(sharding.out_src_shardings),
        out_dst_shardings=each(sharding.out_dst_shardings),
        local_map=local_map,
    )


def _vision_inner_attention_sharding(
    decoder_style: ShardingConfig, activation_type=spmd.R
) -> ShardingConfig:
    """Vision attention keeps q, k, v and its output ``activation_type`` on cp.

    Upstream reuses the decoder's inner-attention layout, which all-gathers k/v
    over cp (the decoder's sequence is CP-sharded). The vision patches are
    already whole on every CP rank, so that all-gather would make each image
    attend to cp copies of its own patches.
    """

    def on_cp(layout: SpmdLayout, cp_type) -> SpmdLayout:
        return SpmdLayout({**layout.axis_types, CP: cp_type})

    assert decoder_style.in_dst_shardings is not None
    q_layout = on_cp(decoder_style.in_dst_shardings["q_BLNH"], activation_type)
    grad_layout = on_cp(
        decoder_style.in_dst_shardings["q_BLNH"], _grad_type(activation_type)
    )
    qkv = {name: q_layout for name in ("q_BLNH", "k_BLNH", "v_BLNH")}
    return ShardingConfig(
        in_src_shardings=qkv,
        in_dst_shardings=dict(qkv),
        out_src_shardings=q_layout,
        local_map=LocalMapConfig(in_grad_placements=(grad_layout,) * 3),
    )


def _rope_cache_built_replicated(sharding: ShardingConfig) -> ShardingConfig:
    """The vision rope cache stays ``R`` on cp, as the encoder builds it.

    The encoder makes it in its forward from host grids, and a new tensor is
    ``R`` on every axis it is not annotated on (upstream annotates dp and tp).
    With sharded vision each CP rank's cache describes its own images, so this
    type is looser than the value; converting it to ``V`` would change cp and
    tp in one input redistribution, which torchtitan does not support. The
    cache carries no gradient and meets only local ops (rope on ``V`` q/k is
    ``V``), so nothing relies on the looser claim.
    """

    def replicated_on_cp(layouts):
        if not layouts or "rope_cache" not in layouts:
            return layouts
        layout = layouts["rope_cache"]
        return {
            **layouts,
            "rope_cache": SpmdLayout(
                {**layout.axis_types, CP: spmd.R},
                partition_spec=layout.partition_spec,
            ),
        }

    return dataclasses.replace(
        sharding,
        in_src_shardings=replicated_on_cp(sharding.in_src_shardings),
        in_dst_shardings=replicated_on_cp(sharding.in_dst_shardings),
    )


def set_cp_vision_sharding_config(model_config, *, sharded: bool = False) -> None:
    """Declare the vision modules' cp types (a no-op axis when cp == 1).

    Parameters are ``R`` on cp either way; activations ``R``, or ``V`` when
    ``sharded`` (each CP rank encodes its own share of the images).
    """
    activation_type = spmd.V if sharded else spmd.R
    for name in VISION_MODULE_FQNS:
        module_config = getattr(model_config, name, None)
        if module_config is None:
            continue
        for _, config, _, _ in module_config.traverse(Module.Config, recurse=True):
            if config.sharding_config is not None:
                config.sharding_config = _on_cp_everywhere(
                    config.sharding_config, activation_type
                )
        for _, attention, _, _ in module_config.traverse(VisionAttention.Config):
            attention.sharding_config = _rope_cache_built_replicated(
                attention.sharding_config
            )
            inner = attention.inner_attention
            inner.sharding_config = _vision_inner_attention_sharding(
                inner.sharding_config, activation_type
            )
