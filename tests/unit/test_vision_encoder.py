"""The backported position resampler (torchtitan PR #4244) samples the right cells."""

import pytest
import torch
from torchtitan.models.muse_glimmer import vision_encoder as upstream

from torchtitan_ext.muse_glimmer import vision_pos_embed

_CPU = torch.device("cpu")


def _resampled_at_own_size(resample, grid_h: int, grid_w: int):
    table_ND = torch.randn(
        grid_h * grid_w, 8, generator=torch.Generator().manual_seed(0)
    )
    sampled_ND = resample(
        table_ND,
        grid_h=grid_h,
        grid_w=grid_w,
        src_grid_h=grid_h,
        src_grid_w=grid_w,
        latent_dim=8,
        device=_CPU,
    )
    return table_ND, sampled_ND


@pytest.mark.parametrize(("grid_h", "grid_w"), [(2, 2), (3, 5), (5, 3), (2, 6)])
def test_a_grid_resampled_to_its_own_size_is_itself(grid_h, grid_w):
    """At its own cell centres the learned grid comes back cell for cell,
    height-major like the patches: for non-square grids as for square ones."""
    table_ND, sampled_ND = _resampled_at_own_size(vision_pos_embed, grid_h, grid_w)
    torch.testing.assert_close(sampled_ND, table_ND, rtol=0, atol=1e-6)


def test_torchtitan_030_resampler_is_wrong_only_off_the_square():
    """The bug the backport fixes: 0.3.0 passes square grids and fails the rest."""
    table_ND, sampled_ND = _resampled_at_own_size(upstream._vision_pos_embed, 3, 3)
    torch.testing.assert_close(sampled_ND, table_ND, rtol=0, atol=1e-6)
    table_ND, sampled_ND = _resampled_at_own_size(upstream._vision_pos_embed, 3, 5)
    assert (sampled_ND - table_ND).abs().max() > 0.5
