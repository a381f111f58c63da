"""Splitting a batch's images over CP ranks: contiguous, balanced, deterministic."""

import functools
import random

import pytest
import torch

from torchtitan_ext.muse_glimmer import (
    VisionGeometry,
    cp_vision_share,
    image_encoding_cost,
    post_process_with_vision_bank_indices,
    split_images_over_cp,
)
from torchtitan_ext.muse_glimmer.vision_bank import tokens_per_image

IMAGE_ID = 4


def _best_bottleneck(costs: list[int], parts: int) -> int:
    """Brute force: the smallest largest-range cost of any contiguous split."""

    @functools.cache
    def best(start: int, parts_left: int) -> int:
        if parts_left == 1:
            return sum(costs[start:])
        options = [
            max(sum(costs[start:cut]), best(cut, parts_left - 1))
            for cut in range(start, len(costs) + 1)
        ]
        return min(options)

    return best(0, parts)


def _check_layout(ranges: list[tuple[int, int]], n: int, cp: int) -> None:
    assert len(ranges) == cp
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (_, stop), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert stop == start  # contiguous, in rank order
    assert all(start <= stop for start, stop in ranges)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_split_is_contiguous_and_as_balanced_as_any(cp):
    rng = random.Random(cp)
    for _ in range(40):
        n = rng.randint(0, 12)
        costs = [rng.choice([0, 1, 4, 16, 64, 1000]) for _ in range(n)]
        ranges = split_images_over_cp(costs, cp)
        _check_layout(ranges, n, cp)
        largest = max(sum(costs[a:b]) for a, b in ranges)
        assert largest == _best_bottleneck(costs, cp), (costs, ranges)
        nonempty = sum(b > a for a, b in ranges)
        assert nonempty == min(n, cp), (costs, ranges)


def test_fewer_images_than_ranks():
    assert split_images_over_cp([7, 3], 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert split_images_over_cp([], 2) == [(0, 0), (0, 0)]


def test_one_image_much_larger_than_the_rest():
    costs = [1, 1, 1000, 1, 1, 1]
    ranges = split_images_over_cp(costs, 4)
    assert (2, 3) in ranges  # alone on its rank
    _check_layout(ranges, len(costs), 4)
    assert max(sum(costs[a:b]) for a, b in ranges) == 1000


def test_equal_images_split_evenly():
    assert split_images_over_cp([5] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    ranges = split_images_over_cp([5] * 7, 4)
    assert sorted(b - a for a, b in ranges) == [1, 2, 2, 2]


def test_costs_from_a_batch_grid():
    grid_thw_N3 = torch.tensor([[1, 4, 4], [1, 2, 2], [1, 8, 8], [1, 2, 2]])
    patches = grid_thw_N3.prod(dim=-1).tolist()
    costs = [image_encoding_cost(p, vision_dim=32) for p in patches]
    assert costs == [16 * 208, 4 * 196, 64 * 256, 4 * 196]
    ranges = split_images_over_cp(costs, 2)
    assert ranges == [(0, 2), (2, 4)]
    rows = tokens_per_image(grid_thw_N3, spatial_merge_size=2).tolist()
    assert [sum(rows[a:b]) for a, b in ranges] == [5, 17]


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="cp_degree must be at least 1, got 0"):
        split_images_over_cp([1], 0)
    with pytest.raises(ValueError, match=r"non-negative, got \[1, -2\]"):
        split_images_over_cp([1, -2], 2)


def _post_process(inputs, labels):  # upstream's, without CP and typing
    return inputs["input"], labels, {k: v for k, v in inputs.items() if k != "input"}


@pytest.mark.parametrize("cp_rank", [0, 1, 2])
def test_preprocessing_gives_the_model_this_ranks_share(cp_rank):
    """Indices from every image; pixels of this rank's share (a blank if none)."""
    geometry = VisionGeometry(spatial_merge_size=2, patch_dim=6, vision_dim=8)
    grid_thw_N3 = torch.tensor([[1, 2, 2], [1, 4, 4]])  # 1 and 4 bank rows
    pixel_values_NPD = torch.randn(2, 16, 6)
    tokens_BL = torch.full((1, 12), 7)
    tokens_BL[0, 1] = IMAGE_ID
    tokens_BL[0, 4:8] = IMAGE_ID
    share = cp_vision_share(
        grid_thw_N3,
        cp_degree=3,
        cp_rank=cp_rank,
        spatial_merge_size=2,
        vision_dim=8,
    )
    assert share.rows_per_rank == (1, 4, 0)
    input_dict = {
        "input": tokens_BL,
        "pixel_values": pixel_values_NPD,
        "grid_thw": grid_thw_N3,
        "special_tokens": {"image_id": IMAGE_ID},
        "cp_vision_share": share,
    }
    _, _, kwargs = post_process_with_vision_bank_indices(
        _post_process, input_dict, tokens_BL, geometry
    )
    assert kwargs["cp_vision_share"] is share
    want = torch.full((1, 12), -1)
    want[0, 1], want[0, 4:8] = 0, torch.arange(1, 5)
    assert torch.equal(kwargs["vision_bank_indices"], want)
    start, stop = share.image_range
    if stop > start:
        assert torch.equal(kwargs["pixel_values"], pixel_values_NPD[start:stop])
        assert torch.equal(kwargs["grid_thw"], grid_thw_N3[start:stop])
    else:  # rank 2 has no image: it encodes a blank one and sends no row
        assert torch.equal(kwargs["grid_thw"], torch.tensor([[1, 2, 2]]))
        assert not kwargs["pixel_values"].any()
