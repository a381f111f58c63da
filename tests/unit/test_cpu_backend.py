"""The CPU backend: eager flex attention against a materialized-mask reference."""

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask
from torchtitan.models.common.attention import (
    FlexAttention,
    get_causal_mask_mod,
    get_document_mask_mod,
    get_sliding_window_mask_mod,
)
from torchtitan.tools import utils as tt_utils

from torchtitan_ext import cpu_backend

B, N, L, H = 2, 2, 48, 8


def _reference_attention(q_BNLH, k_BNLH, v_BNLH, mask_BLL):
    scores_BNLL = q_BNLH @ k_BNLH.transpose(-1, -2) / H**0.5
    scores_BNLL = scores_BNLL.masked_fill(~mask_BLL[:, None], float("-inf"))
    probs_BNLL = torch.softmax(scores_BNLL, dim=-1)
    # A query that sees no key gets a zero output, as flex attention defines it.
    probs_BNLL = torch.nan_to_num(probs_BNLL, nan=0.0)
    return probs_BNLL @ v_BNLH


def _materialize(mask_mod, batch: int) -> torch.Tensor:
    b = torch.arange(batch)[:, None, None]
    q_idx = torch.arange(L)[None, :, None]
    kv_idx = torch.arange(L)[None, None, :]
    return mask_mod(b, torch.zeros_like(b), q_idx, kv_idx)


def _packed_positions() -> torch.Tensor:
    """Positions that restart at 0 where a packed document starts."""
    starts = [(0, 16, 40), (0, 30, 31)]
    positions_BL = torch.zeros(B, L, dtype=torch.long)
    for row, row_starts in enumerate(starts):
        for start, end in zip(row_starts, (*row_starts[1:], L), strict=True):
            positions_BL[row, start:end] = torch.arange(end - start)
    return positions_BL


def _fully_masked_row_mod():
    causal = get_causal_mask_mod()

    def mask_mod(b, h, q_idx, kv_idx):
        # Queries 5..7 of batch row 1 attend to nothing.
        blocked = (b == 1) & (q_idx >= 5) & (q_idx < 8)
        return causal(b, h, q_idx, kv_idx) & ~blocked

    return mask_mod


def _document_mask_mod():
    return and_masks(get_causal_mask_mod(), get_document_mask_mod(_packed_positions()))


MASKS = {
    "causal": get_causal_mask_mod,
    "sliding_window": lambda: and_masks(
        get_causal_mask_mod(), get_sliding_window_mask_mod(7)
    ),
    "document": _document_mask_mod,
    "fully_masked_rows": _fully_masked_row_mod,
}


def test_apply_switched_torchtitan_to_cpu():
    assert cpu_backend.is_active()
    assert tt_utils.device_type == "cpu"
    stats = tt_utils.device_module.memory_stats()
    assert stats["active_bytes.all.peak"] > 10 * 2**20


def test_peak_rss_tracks_a_real_allocation():
    tt_utils.device_module.reset_peak_memory_stats()
    before = tt_utils.device_module.memory_stats()["active_bytes.all.peak"]
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    after = tt_utils.device_module.memory_stats()["active_bytes.all.peak"]
    del block
    assert after - before >= 60 * 2**20


@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_eager_flex_matches_reference(mask_name):
    torch.manual_seed(0)
    mask_mod = MASKS[mask_name]()
    block_mask = create_block_mask(mask_mod, B, None, L, L, device="cpu", BLOCK_SIZE=16)
    mask_BLL = _materialize(mask_mod, B)

    q, k, v = (torch.randn(B, L, N, H, requires_grad=True) for _ in range(3))
    out_BLNH = FlexAttention(FlexAttention.Config())(
        q, k, v, attention_masks=block_mask
    )
    grad_out = torch.randn_like(out_BLNH)
    grads = torch.autograd.grad(out_BLNH, (q, k, v), grad_out)

    q_ref, k_ref, v_ref = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref_BNLH = _reference_attention(
        q_ref.transpose(1, 2), k_ref.transpose(1, 2), v_ref.transpose(1, 2), mask_BLL
    )
    ref_BLNH = ref_BNLH.transpose(1, 2)
    ref_grads = torch.autograd.grad(ref_BLNH, (q_ref, k_ref, v_ref), grad_out)

    torch.testing.assert_close(out_BLNH, ref_BLNH, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
    if mask_name == "fully_masked_rows":
        assert out_BLNH[1, 5:8].abs().max() == 0


def test_eager_flex_survives_determinism_rebinding():
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed import utils as dist_utils

    class _SingleRank:
        world_size = 1
        pp = 1

    dist_utils.set_determinism(
        _SingleRank(), torch.device("cpu"), DebugConfig(deterministic=True), []
    )
    try:
        assert FlexAttention._compiled_flex_attn is cpu_backend.eager_flex_attention
    finally:
        torch.use_deterministic_algorithms(False)
