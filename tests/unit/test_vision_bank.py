"""Bank indices and the gather injection, against hand-made batches and upstream."""

import re
import warnings

import pytest
import torch

from torchtitan_ext.muse_glimmer import (
    build_vision_bank_indices,
    check_pixels_match_grids,
    check_vision_placeholders,
    gather_vision_rows,
)
from torchtitan_ext.tools.upstream_injection import UpstreamInjection

IMAGE = 9
MERGE = 2  # spatial merge: an image of grid (1, h, w) has h * w / 4 bank rows


def _bank(tokens, grid_thw):
    return build_vision_bank_indices(
        tokens, grid_thw, image_id=IMAGE, spatial_merge_size=MERGE
    )


def _check(tokens, grid_thw):
    check_vision_placeholders(
        tokens, grid_thw, image_id=IMAGE, spatial_merge_size=MERGE
    )


def _grids(rows_per_image: list[int]) -> torch.Tensor:
    """One image per entry with that many bank rows: grid (1, 2, 2 * rows)."""
    return torch.tensor([[1, 2, 2 * rows] for rows in rows_per_image])


# Row 0: image 0 (2 rows) at 1..2, image 1 (1 row) at 4, image 2 (4 rows) cut by
# the end of the row after 3 placeholders. Row 1 starts with image 3 (3 rows),
# right after row 0 ended inside an image. Bank: 2 + 1 + 4 + 3 = 10 rows.
HAND_TOKENS = torch.tensor(
    [
        [1, IMAGE, IMAGE, 2, IMAGE, 3, 4, IMAGE, IMAGE, IMAGE],
        [IMAGE, IMAGE, IMAGE, 5, 6, 7, 8, 1, 2, 3],
    ]
)
HAND_GRIDS = torch.tensor([[1, 2, 4], [1, 2, 2], [1, 4, 4], [1, 2, 6]])
HAND_BANK = torch.tensor(
    [
        [-1, 0, 1, -1, 2, -1, -1, 3, 4, 5],
        [7, 8, 9, -1, -1, -1, -1, -1, -1, -1],
    ]
)


def test_hand_batch_exact_indices():
    bank = _bank(HAND_TOKENS, HAND_GRIDS)
    assert bank.dtype == torch.long
    assert torch.equal(bank, HAND_BANK)
    _check(HAND_TOKENS, HAND_GRIDS)  # the cut-by-end run is accepted


def test_hand_batch_image_in_last_row_cut_by_end():
    # Image 1 (4 rows) ends both the batch and row 1 after 2 placeholders.
    tokens = torch.tensor(
        [
            [IMAGE, 1, 2, 3, 4, 5],
            [6, 7, 8, 1, IMAGE, IMAGE],
        ]
    )
    grids = _grids([1, 4])
    expected = torch.tensor([[0, -1, -1, -1, -1, -1], [-1, -1, -1, -1, 1, 2]])
    assert torch.equal(_bank(tokens, grids), expected)
    _check(tokens, grids)


def test_hand_batch_images_after_a_cut_keep_their_rows():
    # Image 0 (3 rows) is cut after 1 placeholder; image 1 starts row 1 at row 3.
    tokens = torch.tensor([[1, 2, 3, IMAGE], [IMAGE, IMAGE, 4, IMAGE]])
    grids = _grids([3, 2, 1])
    expected = torch.tensor([[-1, -1, -1, 0], [3, 4, -1, 5]])
    assert torch.equal(_bank(tokens, grids), expected)
    _check(tokens, grids)


def _random_batch(
    generator: torch.Generator, batch: int, seq_len: int, max_rows: int = 12
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text tokens in [0, 8) with whole, separated image runs (none cut)."""
    tokens = torch.randint(0, 8, (batch, seq_len), generator=generator)
    rows_per_image: list[int] = []
    for row in range(batch):
        position = int(torch.randint(0, 3, (), generator=generator))
        while True:
            rows = int(torch.randint(1, max_rows + 1, (), generator=generator))
            if position + rows + 1 > seq_len:  # keep a text token after each run
                break
            tokens[row, position : position + rows] = IMAGE
            rows_per_image.append(rows)
            position += rows + 1 + int(torch.randint(0, 6, (), generator=generator))
    if not rows_per_image:  # every batch has an image
        tokens[0, 0] = IMAGE
        rows_per_image.append(1)
    grids = torch.tensor(
        [
            [1, 2 * a, 2 * (rows // a)]
            for rows in rows_per_image
            for a in [next(d for d in (3, 2, 1) if rows % d == 0)]
        ]
    )
    return tokens, grids


SHAPES = [(1, 1), (1, 7), (2, 64), (3, 100), (4, 257), (2, 512)]


@pytest.mark.parametrize("batch, seq_len", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches_follow_upstream_row_major_order(batch, seq_len, seed):
    generator = torch.Generator().manual_seed(1000 * seed + seq_len)
    tokens, grids = _random_batch(generator, batch, seq_len)
    bank = _bank(tokens, grids)
    is_image = tokens == IMAGE
    # Upstream consumes the bank in row-major order of the placeholders.
    expected = torch.where(
        is_image, torch.cumsum(is_image.flatten(), 0).view_as(bank) - 1, -1
    )
    assert torch.equal(bank, expected)
    assert torch.equal(is_image, bank >= 0)
    assert int(is_image.sum()) == int((grids.prod(-1) // MERGE**2).sum())
    _check(tokens, grids)


def _message(tokens, grids) -> str:
    with pytest.raises(ValueError, match="Multimodal batch mismatch") as error:
        _check(tokens, grids)
    return str(error.value)


def _with(tokens: torch.Tensor, row: int, start: int, stop: int, value: int):
    tokens = tokens.clone()
    tokens[row, start:stop] = value
    return tokens


def test_check_rejects_too_many_placeholders():
    tokens = _with(HAND_TOKENS, 0, 5, 6, IMAGE)  # image 1: 2 placeholders, 1 row
    message = _message(tokens, HAND_GRIDS)
    assert "image 1 has 2 placeholders for 1 rows" in message
    assert "10 image placeholder tokens in 4 run(s)" in message
    assert "has 10 rows from 4 image(s)" in message


def test_check_rejects_too_many_placeholders_at_the_end_of_a_row():
    tokens = torch.tensor([[1, 2, IMAGE, IMAGE, IMAGE]])
    message = _message(tokens, _grids([2]))
    assert "image 0 has 3 placeholders for 2 rows" in message


def test_check_rejects_too_few_placeholders():
    tokens = _with(HAND_TOKENS, 1, 2, 3, 5)  # image 3: 2 placeholders for 3 rows
    message = _message(tokens, HAND_GRIDS)
    assert "image 3 has 2 placeholders for 3 rows" in message
    assert "8 image placeholder tokens in 4 run(s)" in message
    assert "has 10 rows from 4 image(s)" in message


def test_check_rejects_an_extra_run():
    tokens = _with(HAND_TOKENS, 1, 5, 6, IMAGE)
    message = _message(tokens, HAND_GRIDS)
    assert "10 image placeholder tokens in 5 run(s)" in message
    assert "has 10 rows from 4 image(s)" in message


def test_check_rejects_a_missing_run():
    tokens = _with(HAND_TOKENS, 0, 4, 5, 3)  # image 1's single placeholder gone
    message = _message(tokens, HAND_GRIDS)
    assert "8 image placeholder tokens in 3 run(s)" in message
    assert "has 10 rows from 4 image(s)" in message


def test_check_rejects_placeholders_without_images():
    message = _message(HAND_TOKENS, None)
    assert "9 image placeholder tokens in 4 run(s)" in message
    assert "has 0 rows from 0 image(s)" in message
    _check(torch.zeros(2, 5, dtype=torch.long), None)  # text only: fine


def _compare_with_upstream(tokens, grids, h_dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = tokens.shape
    n_rows = int((grids.prod(-1) // MERGE**2).sum())
    dim = 8
    h0 = torch.randn(batch, seq_len, dim, generator=generator).to(h_dtype)
    bank0 = torch.randn(n_rows, dim, generator=generator)
    weight = torch.randn(batch, seq_len, dim, generator=generator).to(h_dtype)

    h_ours = h0.clone().requires_grad_()
    bank_ours = bank0.clone().requires_grad_()
    # A non-leaf, as the embedding output in the model.
    ours = gather_vision_rows(h_ours.clone(), bank_ours, _bank(tokens, grids))
    (ours * weight).sum().backward()

    h_up = h0.clone().requires_grad_()
    bank_up = bank0.clone().requires_grad_()
    upstream = UpstreamInjection()._inject_vision(
        h_up.clone(), bank_up.unsqueeze(0), tokens == IMAGE
    )
    (upstream * weight).sum().backward()

    assert ours.dtype == upstream.dtype == h_dtype
    assert torch.equal(ours, upstream)
    assert torch.equal(h_ours.grad, h_up.grad)
    assert torch.equal(bank_ours.grad, bank_up.grad)
    # Not vacuous: images were injected and text kept.
    is_image = tokens == IMAGE
    assert torch.equal(ours[~is_image], h0[~is_image])
    assert torch.equal(ours[is_image], bank0.to(h_dtype))


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, seq_len", SHAPES[1:])
def test_gather_matches_upstream_span_injection(batch, seq_len, h_dtype):
    generator = torch.Generator().manual_seed(seq_len)
    tokens, grids = _random_batch(generator, batch, seq_len)
    _compare_with_upstream(tokens, grids, h_dtype, seed=batch)


def test_gather_matches_upstream_with_image_at_row_start():
    # HAND_TOKENS without the cut (upstream rejects a cut span): image 2 -> 3 rows.
    grids = _grids([2, 1, 3, 3])
    _compare_with_upstream(HAND_TOKENS, grids, torch.float32, seed=0)


def _upstream_reference(tokens, grids, h0, bank0, weight):
    h_up = h0.clone().requires_grad_()
    bank_up = bank0.clone().requires_grad_()
    out = UpstreamInjection()._inject_vision(
        h_up.clone(), bank_up.unsqueeze(0), tokens == IMAGE
    )
    (out * weight).sum().backward()
    return out.detach(), h_up.grad, bank_up.grad


def _on_rank(h0, bank0, weight, bank_indices, positions):
    """One CP rank: inject into the positions it holds (per batch row)."""
    index = positions.unsqueeze(-1).expand(-1, -1, h0.shape[-1])
    h = h0.gather(1, index).requires_grad_()
    bank = bank0.clone().requires_grad_()
    out = gather_vision_rows(h.clone(), bank, bank_indices.gather(1, positions))
    (out * weight.gather(1, index)).sum().backward()
    return out.detach(), h.grad, bank.grad, index


# Row 0: image 0 at 1..2, image 1 at 4. Row 1: image 2 at 0..2, image 3 at 6..7.
CP_TOKENS = torch.tensor(
    [
        [1, IMAGE, IMAGE, 2, IMAGE, 3, 4, 5],
        [IMAGE, IMAGE, IMAGE, 5, 6, 7, IMAGE, IMAGE],
    ]
)
CP_GRIDS = _grids([2, 1, 3, 2])
# Each rank's held positions per row (CP-permuted, as ptrr may order them), and
# bank rows: rank 0 holds 0, 4, 6 and ends on a placeholder; rank 1 holds 1, 2,
# 5, 3 and ends on text; rank 2 holds only text in row 0 and ends on row 7,
# the batch's last placeholder. The rows a rank does not hold share its last
# position as their write target.
CP_LAYOUTS = [
    torch.tensor([[5, 1, 6], [4, 1, 6]]),
    torch.tensor([[2, 4, 3], [2, 0, 3]]),
    torch.tensor([[7, 0], [5, 7]]),
]


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
def test_cp_ranks_write_their_rows_and_sum_to_upstream_gradients(h_dtype):
    """Shards, gradients that cover only the rows held; their sum is upstream's."""
    generator = torch.Generator().manual_seed(3)
    h0 = torch.randn(2, 8, 4, generator=generator).to(h_dtype)
    bank0 = torch.randn(8, 4, generator=generator)
    weight = torch.randn(2, 8, 4, generator=generator).to(h_dtype)
    bank_indices = _bank(CP_TOKENS, CP_GRIDS)
    out_up, grad_h_up, grad_bank_up = _upstream_reference(
        CP_TOKENS, CP_GRIDS, h0, bank0, weight
    )
    # The layouts cover every position: ranks 0 and 1 three each, rank 2 two.
    held = torch.cat(CP_LAYOUTS, dim=1).sort(dim=1).values
    assert torch.equal(held, torch.arange(8).expand(2, 8))

    grad_bank_sum = torch.zeros_like(bank0)
    for rank, positions in enumerate(CP_LAYOUTS):
        out, grad_h, grad_bank, index = _on_rank(
            h0, bank0, weight, bank_indices, positions
        )
        assert torch.equal(out, out_up.gather(1, index)), rank
        assert torch.equal(grad_h, grad_h_up.gather(1, index)), rank
        rows_here = bank_indices.gather(1, positions)
        rows_here = rows_here[rows_here >= 0]
        elsewhere = torch.ones(len(bank0), dtype=torch.bool)
        elsewhere[rows_here] = False
        assert torch.equal(grad_bank[rows_here], grad_bank_up[rows_here]), rank
        assert not grad_bank[elsewhere].any(), rank
        grad_bank_sum += grad_bank
    assert torch.equal(grad_bank_sum, grad_bank_up)


def test_rank_without_placeholders_keeps_its_embeddings():
    h0 = torch.randn(1, 5, 3)
    bank0 = torch.randn(4, 3, requires_grad=True)
    h = h0.clone().requires_grad_()
    out = gather_vision_rows(h.clone(), bank0, torch.full((1, 5), -1))
    assert torch.equal(out, h0)
    out.sum().backward()
    assert torch.equal(h.grad, torch.ones_like(h0))
    assert torch.equal(bank0.grad, torch.zeros_like(bank0))


def test_deterministic_mode_neither_warns_nor_raises():
    # Rows held elsewhere share one target: deterministic mode must accept it.
    generator = torch.Generator().manual_seed(4)
    h0 = torch.randn(2, 8, 4, generator=generator)
    bank0 = torch.randn(8, 4, generator=generator)
    weight = torch.randn(2, 8, 4, generator=generator)
    bank_indices = _bank(CP_TOKENS, CP_GRIDS)
    expected = _on_rank(h0, bank0, weight, bank_indices, CP_LAYOUTS[1])
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _on_rank(h0, bank0, weight, bank_indices, CP_LAYOUTS[1])
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(map(torch.equal, got, expected))


def _collated(grids: list[list[int]], padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values as the collator pads them: each image's patches, then zeros."""
    generator = torch.Generator().manual_seed(0)
    pixels_NPD = torch.zeros(len(grids), padded, 6)
    for image, grid in enumerate(grids):
        patches = grid[0] * grid[1] * grid[2]
        pixels_NPD[image, :patches] = torch.rand(patches, 6, generator=generator) + 0.1
    return pixels_NPD, torch.tensor(grids)


def test_pixels_that_match_their_grids_pass():
    check_pixels_match_grids(*_collated([[1, 2, 4], [1, 4, 4], [1, 2, 2]], 16))


@pytest.mark.parametrize(
    ("grids", "named"),
    [
        # A grid short of its image: the encoder would read a cut image.
        (
            [[1, 2, 4], [1, 2, 4], [1, 2, 2]],
            "image 1's grid [1, 2, 4] claims 8 patches, but it has pixels past them",
        ),
        # One grid row fewer than images: every later image's features shift.
        (
            [[1, 2, 4], [1, 4, 4]],
            "pixel_values has 3 image(s) of 16 padded patches, grid_thw 2 row(s)",
        ),
        # A grid past the padding: a raw error deep in the encoder otherwise.
        (
            [[1, 2, 4], [1, 4, 6], [1, 2, 2]],
            "image 1's grid [1, 4, 6] claims 24 patches",
        ),
    ],
    ids=["grid_short_of_image", "grid_row_missing", "grid_past_padding"],
)
def test_pixels_that_disagree_with_their_grids_are_named(grids, named):
    pixels_NPD, _ = _collated([[1, 2, 4], [1, 4, 4], [1, 2, 2]], 16)
    with pytest.raises(ValueError, match=re.escape(named)):
        check_pixels_match_grids(pixels_NPD, torch.tensor(grids))
