"""muse_glimmer's vision encoder with non-square position grids sampled right.

Backport of torchtitan PR #4244 ("Fix non-square vision position
interpolation", merged after 0.3.0): 0.3.0's ``_vision_pos_embed`` hands
``grid_sample`` (y, x) pairs in width-major order, two swaps that cancel only
for square grids, so every other image takes its learned position embeddings
from the wrong place. transformers' muse_glimmer (what the released weights
were trained with) agrees with the fix. Drop this module once a torchtitan
release carries it: ``tests/unit/test_upstream_guards.py`` fails when the
installed ``_vision_pos_embed`` changes.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.muse_glimmer.vision_encoder import (
    MuseGlimmerVisionEncoder as _UpstreamEncoder,
)
from torchtitan.models.muse_glimmer.vision_encoder import (
    _annotate_vision_activation_type,
)

__all__ = ["MuseGlimmerVisionEncoder", "vision_pos_embed"]


def vision_pos_embed(
    pos_param: torch.Tensor,
    *,
    grid_h: int,
    grid_w: int,
    src_grid_h: int,
    src_grid_w: int,
    latent_dim: int,
    device: torch.device,
) -> torch.Tensor:
    """The learned ``src_grid_h x src_grid_w`` grid resampled to ``grid_h x grid_w``.

    As PR #4244 writes it: ``ij`` indexing, (x, y) pairs as ``grid_sample``
    reads them, rows in height-major raster order like the patches.
    """
    dtype = pos_param.dtype
    pos_emb = (
        pos_param.view(src_grid_h, src_grid_w, latent_dim).permute(2, 0, 1).unsqueeze(0)
    )
    inv_h = 1.0 / grid_h
    inv_w = 1.0 / grid_w
    ys = torch.linspace(-1 + inv_h, 1 - inv_h, grid_h, device=device, dtype=dtype)
    xs = torch.linspace(-1 + inv_w, 1 - inv_w, grid_w, device=device, dtype=dtype)
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    pos_xy = torch.stack((xx, yy), dim=-1).reshape(-1, 2)[None, None]
    pos_xy = _annotate_vision_activation_type(pos_xy)
    sampled = F.grid_sample(pos_emb, pos_xy, mode="bilinear", align_corners=False)
    return sampled[0, :, 0, :].T


class MuseGlimmerVisionEncoder(_UpstreamEncoder):
    """torchtitan's encoder, its position grid resampled by ``vision_pos_embed``."""

    @dataclass(kw_only=True, slots=True)
    class Config(_UpstreamEncoder.Config):
        pass

    def _get_pos_emb(
        self, grid_h: int, grid_w: int, device: torch.device
    ) -> torch.Tensor:
        return vision_pos_embed(
            self.positional_embedding_vlm,
            grid_h=grid_h,
            grid_w=grid_w,
            src_grid_h=self.pos_emb_grid_h,
            src_grid_w=self.pos_emb_grid_w,
            latent_dim=self.latent_dim,
            device=device,
        )
