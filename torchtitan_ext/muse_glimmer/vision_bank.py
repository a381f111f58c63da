"""Map every token to its row of the vision-feature bank, before CP sharding.

The encoder + adapter turn a batch's images into one feature bank whose rows are
laid out image after image, in the order the collator lists the images (row-major
over the batch). Upstream finds each image's placeholder span at injection time,
which needs the whole sequence; once context parallelism permutes and shards
the tokens, no rank can. Built from the unsharded tokens and sharded with them,
``vision_bank_indices`` lets every rank gather its own rows.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CpVisionShare",
    "build_vision_bank_indices",
    "check_pixels_match_grids",
    "check_vision_placeholders",
    "cp_vision_share",
    "image_encoding_cost",
    "split_images_over_cp",
    "tokens_per_image",
]


def tokens_per_image(
    grid_thw_N3: torch.Tensor, spatial_merge_size: int
) -> torch.Tensor:
    """Feature-bank rows each image contributes (``t * h * w / merge**2``)."""
    return grid_thw_N3.to(torch.long).prod(dim=-1) // spatial_merge_size**2


def _placeholder_runs(is_image_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per placeholder: its run (one per image, row-major) and offset in the run."""
    starts_run_BL = is_image_BL.clone()
    starts_run_BL[:, 1:] &= ~is_image_BL[:, :-1]
    run_id_T = torch.cumsum(starts_run_BL.flatten(), dim=0) - 1
    flat_index_T = torch.arange(is_image_BL.numel(), device=is_image_BL.device)
    run_start_T = torch.where(starts_run_BL.flatten(), flat_index_T, 0).cummax(dim=0)
    offset_in_run_T = flat_index_T - run_start_T.values
    return run_id_T.view_as(is_image_BL), offset_in_run_T.view_as(is_image_BL)


def build_vision_bank_indices(
    tokens_BL: torch.Tensor,
    grid_thw_N3: torch.Tensor,
    *,
    image_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """Row of the feature bank for every image placeholder; -1 for every other token.

    The k-th placeholder run takes image k's rows from its first row on, so a run
    cut short by the end of a sequence still maps to the right rows, and the
    images after it are unaffected. Device-side only: no host synchronization.
    """
    is_image_BL = tokens_BL == image_id
    run_id_BL, offset_in_run_BL = _placeholder_runs(is_image_BL)
    rows_per_image_N = tokens_per_image(grid_thw_N3, spatial_merge_size)
    first_row_N = torch.cumsum(rows_per_image_N, dim=0) - rows_per_image_N
    run_id_BL = run_id_BL.clamp(0, max(first_row_N.numel() - 1, 0))
    bank_row_BL = first_row_N[run_id_BL] + offset_in_run_BL
    return torch.where(is_image_BL, bank_row_BL, -1)


def check_vision_placeholders(
    tokens_BL: torch.Tensor,
    grid_thw_N3: torch.Tensor | None,
    *,
    image_id: int,
    spatial_merge_size: int,
) -> None:
    """Raise unless the placeholders and the feature bank describe the same images.

    Each image must own one placeholder run of exactly its row count; only a run
    that reaches the end of its sequence may be shorter (the collator truncates
    there). Every rank of a CP group holds the same unsharded batch, so all of
    them raise the same error before any collective. Meant for the CPU batch.
    """
    is_image_BL = tokens_BL == image_id
    rows_N = (
        tokens_per_image(grid_thw_N3, spatial_merge_size)
        if grid_thw_N3 is not None
        else torch.zeros(0, dtype=torch.long)
    )
    run_id_BL, _ = _placeholder_runs(is_image_BL)
    run_length_R = torch.bincount(run_id_BL[is_image_BL])
    summary = (
        f"{int(is_image_BL.sum())} image placeholder tokens in "
        f"{len(run_length_R)} run(s), but the vision-feature bank has "
        f"{int(rows_N.sum())} rows from {len(rows_N)} image(s)"
    )
    if len(run_length_R) != len(rows_N):
        raise ValueError(
            f"Multimodal batch mismatch: {summary}; each image needs one run."
        )
    cut_by_end_R = torch.zeros(len(run_length_R), dtype=torch.bool)
    cut_by_end_R[run_id_BL[:, -1][is_image_BL[:, -1]]] = True
    bad_R = (run_length_R > rows_N) | ((run_length_R < rows_N) & ~cut_by_end_R)
    if bool(bad_R.any()):
        image = int(bad_R.nonzero()[0])
        raise ValueError(
            f"Multimodal batch mismatch: {summary}; image {image} has "
            f"{int(run_length_R[image])} placeholders for {int(rows_N[image])} rows."
        )


def check_pixels_match_grids(
    pixel_values_NPD: torch.Tensor, grid_thw_N3: torch.Tensor
) -> None:
    """Raise unless each image's padded patches are what its grid claims.

    The collator writes image ``n``'s ``t * h * w`` patches first and pads with
    zeros. The encoder reads the patches the grid names, so a grid row short of
    its image encodes a cut image silently, and a missing row shifts every later
    image's features; a grid past the padding fails deep in the encoder without
    a name. Meant for the CPU batch, as ``check_vision_placeholders``.
    """
    patches_N = grid_thw_N3.prod(dim=-1)
    summary = (
        f"pixel_values has {pixel_values_NPD.shape[0]} image(s) of "
        f"{pixel_values_NPD.shape[1]} padded patches, grid_thw {grid_thw_N3.shape[0]}"
    )
    if pixel_values_NPD.shape[0] != grid_thw_N3.shape[0]:
        raise ValueError(f"Multimodal batch mismatch: {summary} row(s).")
    for image, patches in enumerate(patches_N.tolist()):
        grid = grid_thw_N3[image].tolist()
        if patches > pixel_values_NPD.shape[1]:
            raise ValueError(
                f"Multimodal batch mismatch: {summary} rows; image {image}'s grid "
                f"{grid} claims {patches} patches."
            )
        if bool(pixel_values_NPD[image, patches:].any()):
            raise ValueError(
                f"Multimodal batch mismatch: {summary} rows; image {image}'s grid "
                f"{grid} claims {patches} patches, but it has pixels past them."
            )


def image_encoding_cost(patches: int, vision_dim: int) -> int:
    """Relative cost of encoding an image of ``patches`` patches: ``p * (p + 6 d)``.

    Per vision block, the q/k/v/output projections and a 4x MLP take
    ``24 p d**2`` FLOPs and attention (scores, then their product with v)
    ``4 p**2 d``: ``4 p d (p + 6 d)`` in all. Only ratios between images matter.
    """
    return patches * (patches + 6 * vision_dim)


def split_images_over_cp(costs: Sequence[int], cp_degree: int) -> list[tuple[int, int]]:
    """Contiguous image ranges ``[start, stop)``, one per CP rank, in rank order.

    The largest range cost is the smallest any contiguous split achieves; every
    rank gets at least one image while there are enough. A pure function of
    host integers, so every CP rank computes the same split with no
    communication. Ranks past the last image get an empty range.
    """
    if cp_degree < 1:
        raise ValueError(f"cp_degree must be at least 1, got {cp_degree}")
    if any(c < 0 for c in costs):
        raise ValueError(f"image costs must be non-negative, got {list(costs)}")
    n = len(costs)
    ranges = _fill_ranges(costs, _smallest_bottleneck(costs, cp_degree))
    while len(ranges) < min(cp_degree, n):
        ranges = _split_costliest(ranges, costs)
    ranges += [(n, n)] * (cp_degree - len(ranges))
    return ranges


def _range_cost(costs: Sequence[int], start: int, stop: int) -> int:
    return sum(costs[start:stop])


def _fill_ranges(costs: Sequence[int], bottleneck: int) -> list[tuple[int, int]]:
    """Left to right, each range as long as it stays within ``bottleneck``."""
    ranges: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, cost in enumerate(costs):
        if i > start and total + cost > bottleneck:
            ranges.append((start, i))
            start, total = i, 0
        total += cost
    if start < len(costs):
        ranges.append((start, len(costs)))
    return ranges


def _smallest_bottleneck(costs: Sequence[int], parts: int) -> int:
    """The least B such that ``parts`` contiguous ranges of cost <= B hold all."""
    low, high = max(costs, default=0), sum(costs)
    while low < high:
        mid = (low + high) // 2
        if len(_fill_ranges(costs, mid)) <= parts:
            high = mid
        else:
            low = mid + 1
    return low


def _split_costliest(
    ranges: list[tuple[int, int]], costs: Sequence[int]
) -> list[tuple[int, int]]:
    """Split the costliest range of two or more images where its halves balance."""
    splittable = [r for r in ranges if r[1] - r[0] > 1]
    start, stop = max(splittable, key=lambda r: _range_cost(costs, *r))
    cut = min(
        range(start + 1, stop),
        key=lambda c: max(_range_cost(costs, start, c), _range_cost(costs, c, stop)),
    )
    i = ranges.index((start, stop))
    return [*ranges[:i], (start, cut), (cut, stop), *ranges[i + 1 :]]


@dataclass(frozen=True)
class CpVisionShare:
    """The images one CP rank encodes in sharded-vision mode, and every rank's rows.

    ``rows_per_rank`` lists the bank rows each CP rank contributes, in rank
    order; their concatenation is the replicated bank, so the bank indices
    built from the whole batch stay valid.
    """

    image_range: tuple[int, int]
    rows_per_rank: tuple[int, ...]
    cp_rank: int


def cp_vision_share(
    grid_thw_N3: torch.Tensor,
    *,
    cp_degree: int,
    cp_rank: int,
    spatial_merge_size: int,
    vision_dim: int,
) -> CpVisionShare:
    """Split a batch's images over its CP ranks by encoding cost; this rank's share.

    For the CPU batch: it reads ``grid_thw`` on the host. Every rank of the CP
    group holds the same batch and computes the same split.
    """
    patches_N = [t * h * w for t, h, w in grid_thw_N3.tolist()]
    ranges = split_images_over_cp(
        [image_encoding_cost(p, vision_dim) for p in patches_N], cp_degree
    )
    rows_N = [p // spatial_merge_size**2 for p in patches_N]  # tokens_per_image
    return CpVisionShare(
        image_range=ranges[cp_rank],
        rows_per_rank=tuple(sum(rows_N[a:b]) for a, b in ranges),
        cp_rank=cp_rank,
    )
