"""muse_glimmer with vision injection by bank index, so it runs under CP."""

import math
from dataclasses import dataclass

import spmd_types as spmd
import torch
from torchtitan.distributed.parallel_dims import MeshAxisName
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.multimodal import multimodal_context
from torchtitan.models.muse_glimmer.model import MuseGlimmerModel as _UpstreamModel
from torchtitan.models.muse_glimmer.model import _window_mask_key

__all__ = ["VISION_MODULE_FQNS", "MuseGlimmerModel", "gather_vision_rows"]

VISION_MODULE_FQNS = (
    "vision_encoder",
    "vision_adapter",
    "vision_projection",
    "perception_emb_norm",
)
"""The multimodal embedding modules (data-flow order): they feed ``tok_embeddings``."""

DP = MeshAxisName.DP
CP = MeshAxisName.CP
TP = MeshAxisName.TP

# Inside ``multimodal_context`` dp is a local axis: each DP rank encodes its own
# images (V), every CP rank of a DP group encodes the same ones (R).
_VISION_INPUT_TYPE = {DP: spmd.V, CP: spmd.R, TP: spmd.I}
_BANK_TYPE = {DP: spmd.V, CP: spmd.R, TP: spmd.R}
_TOKEN_TYPE = {DP: spmd.V, CP: spmd.S(1), TP: spmd.R}


def _gather_vision_rows_local(
    h_BLD: torch.Tensor,
    vision_bank_TD: torch.Tensor,
    vision_bank_indices_BL: torch.Tensor,
) -> torch.Tensor:
    is_vision_BL1 = (vision_bank_indices_BL >= 0).unsqueeze(-1)
    rows_BLD = vision_bank_TD[vision_bank_indices_BL.clamp(min=0)]
    return torch.where(is_vision_BL1, rows_BLD.to(h_BLD.dtype), h_BLD)


_gather_vision_rows_typed = spmd.local_map(
    in_types=(_TOKEN_TYPE, _BANK_TYPE, _TOKEN_TYPE), out_types=_TOKEN_TYPE
)(_gather_vision_rows_local)


def gather_vision_rows(
    h_BLD: torch.Tensor,
    vision_bank_TD: torch.Tensor,
    vision_bank_indices_BL: torch.Tensor,
) -> torch.Tensor:
    """Replace the embeddings of image placeholders with their vision-bank rows.

    A gather by index: no host sync, no loop over spans, and it works on whatever
    (CP-permuted) slice of the sequence this rank holds. The bank is replicated
    across CP, so autograd scatters each rank's gradient into the rows it used:
    a partial sum on cp that FSDP's reduction over (dp_shard, cp) completes.
    """
    if get_spmd_backend() == "spmd_types" and spmd.is_type_checking():
        return _gather_vision_rows_typed(h_BLD, vision_bank_TD, vision_bank_indices_BL)
    return _gather_vision_rows_local(h_BLD, vision_bank_TD, vision_bank_indices_BL)


class MuseGlimmerModel(_UpstreamModel):
    """torchtitan's muse_glimmer, injecting vision features by ``vision_bank_indices``.

    Same modules and state-dict keys as upstream; only the injection differs.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_UpstreamModel.Config):
        def update_from_config(self, *, config, **kwargs) -> None:
            _UpstreamModel.Config.update_from_config(self, config=config, **kwargs)
            if self.vision_encoder is None:
                return
            self._check_context_parallel(config)
            from .sharding import set_cp_vision_sharding_config

            set_cp_vision_sharding_config(self)

        def _check_context_parallel(self, config) -> None:
            parallelism = config.parallelism
            cp = parallelism.context_parallel_degree
            if cp <= 1:
                return
            tp = parallelism.tensor_parallel_degree
            seq_len = config.training.seq_len
            divisor = math.lcm(2 * tp * cp, 128 * cp)
            if seq_len % divisor != 0:
                lower = seq_len // divisor * divisor
                nearest = [v for v in (lower, lower + divisor) if v > 0]
                raise ValueError(
                    f"training.seq_len={seq_len} must be divisible by "
                    f"lcm(2*tp*cp, 128*cp) = lcm({2 * tp * cp}, {128 * cp}) = "
                    f"{divisor} with tensor_parallel_degree={tp} and "
                    f"context_parallel_degree={cp}; nearest valid values: "
                    f"{', '.join(map(str, nearest))}."
                )
            if parallelism.context_parallel_load_balancer == "ptrr":
                mask_keys = sorted(
                    {
                        _window_mask_key(layer.attention.window_size)
                        for layer in self.layers
                    }
                )
                key = parallelism.context_parallel_ptrr_mask_key
                if key not in mask_keys:
                    raise ValueError(
                        "context_parallel_load_balancer='ptrr' needs "
                        "parallelism.context_parallel_ptrr_mask_key to name one "
                        f"of muse_glimmer's attention masks {mask_keys}; got {key!r}."
                    )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks=None,
        *,
        vision_bank_indices: torch.Tensor | None = None,
        **kwargs,
    ):
        if get_spmd_backend() == "spmd_types":
            with multimodal_context():
                for name in ("pixel_values", "grid_thw"):
                    if kwargs.get(name) is not None:
                        spmd.assert_type(kwargs[name], _VISION_INPUT_TYPE)
        # _inject_vision's signature is upstream's; the indices reach it from here.
        self._vision_bank_indices_BL = vision_bank_indices
        try:
            return super().forward(tokens, positions, attention_masks, **kwargs)
        finally:
            self._vision_bank_indices_BL = None

    def _inject_vision(
        self,
        h: torch.Tensor,
        vision_features: torch.Tensor,
        vision_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Project + norm the bank (replicated over CP); gather this rank's rows."""
        vision_bank_indices_BL = self._vision_bank_indices_BL
        if vision_bank_indices_BL is None:
            raise ValueError(
                "pixel_values were given without vision_bank_indices; build them "
                "with torchtitan_ext.muse_glimmer.build_vision_bank_indices (the "
                "plug-in's Trainer does) before context-parallel sharding."
            )
        assert self.vision_projection is not None
        assert self.perception_emb_norm is not None
        vision_bank_TD = self.perception_emb_norm(
            self.vision_projection(vision_features)
        ).squeeze(0)
        return gather_vision_rows(h, vision_bank_TD, vision_bank_indices_BL)
