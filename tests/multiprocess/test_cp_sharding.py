"""Bank indices through upstream's real CP sharding, on 2 and 4 gloo ranks.

Every rank runs the plug-in's ``post_process_with_vision_bank_indices`` around a
post-process that calls torchtitan's ``prepare_context_parallel_input`` with
muse_glimmer's own (document-aware) attention masks, for each load balancer.
The labels are the global flat index of each token, and upstream shards them
with the tokens, so each rank knows exactly which global positions it holds.
"""

import pytest
import torch

from torchtitan_ext.tools.local_ranks import run_on_ranks

B, L, DIM = 2, 512, 8
IMAGE = 7
MERGE = 2
PATCH_DIM = 1176  # only read for a batch without images
BALANCERS = ("headtail", "ptrr", None)
TIMEOUT_S = 300


# An image's grid_thw by its number of bank rows (h * w / MERGE**2).
IMAGE_GRIDS = {1: (1, 2, 2), 2: (1, 2, 4), 4: (1, 4, 4), 6: (1, 4, 6), 9: (1, 6, 6)}


def _place(taken, spans, start: int, rows: int, length: int | None = None) -> bool:
    """Put an image run at ``start`` unless it would touch another run."""
    length = rows if length is None else length
    if start < 0 or start + length > L:
        return False
    if bool(taken[max(start - 1, 0) : start + length + 1].any()):
        return False
    taken[start : start + length] = True
    spans.append((start, rows))
    return True


def _packed_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """B packed rows: documents (positions restart at 0), separated image runs.

    Images straddle every multiple of 64 (the headtail chunk boundaries for
    cp=4, which include those of cp=2, ptrr's 128-token blocks and the plain
    split), more sit at random offsets, and row 0 ends inside an image.
    """
    generator = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=generator))

    tokens = torch.randint(10, 1000, (B, L), generator=generator)
    positions = torch.empty(B, L, dtype=torch.long)
    spans: list[list[tuple[int, int]]] = []  # per row: (start, rows of the image)
    for row in range(B):
        doc_starts = sorted({0, *(randint(1, L) for _ in range(5))})
        for start, stop in zip(doc_starts, [*doc_starts[1:], L], strict=True):
            positions[row, start:stop] = torch.arange(stop - start)
        row_spans: list[tuple[int, int]] = []
        taken = torch.zeros(L, dtype=torch.bool)
        if row == 0:  # cut by the end of the row: 3 of 9 placeholders
            _place(taken, row_spans, L - 3, 9, length=3)
        for boundary in range(64, L, 64):
            rows = (4, 6, 9)[randint(0, 3)]
            assert _place(taken, row_spans, boundary - randint(1, rows), rows)
        for _ in range(40):
            rows = tuple(IMAGE_GRIDS)[randint(0, len(IMAGE_GRIDS))]
            _place(taken, row_spans, randint(0, L), rows)
        row_spans.sort()
        spans.append(row_spans)
        for start, rows in row_spans:
            tokens[row, start : min(start + rows, L)] = IMAGE
    grid_thw = torch.tensor([IMAGE_GRIDS[rows] for row in spans for _, rows in row])
    n_rows = int((grid_thw.prod(-1) // MERGE**2).sum())
    return {
        "input": tokens,
        "positions": positions,
        "grid_thw": grid_thw,
        "h": torch.randn(B, L, DIM, generator=generator),
        "bank_features": torch.randn(n_rows, DIM, generator=generator),
    }


def _shard_on_rank(cp: int, batch: dict[str, torch.Tensor]) -> dict:
    """On one CP rank: shard ``batch`` with each balancer, check, return its part."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    from torchtitan_ext.muse_glimmer import (
        VisionGeometry,
        build_vision_bank_indices,
        gather_vision_rows,
        model_registry,
        post_process_with_vision_bank_indices,
    )

    rank = dist.get_rank()
    cp_mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    # The plug-in's multimodal debug model, as its packed CP jobs use it.
    model_config = model_registry("debugmodel_mm", attn_backend="flex").model
    with torch.device("meta"):
        model = model_config.build()  # only its get_attention_masks is used
    tokens, positions = batch["input"], batch["positions"]
    global_bank = build_vision_bank_indices(
        tokens, batch["grid_thw"], image_id=IMAGE, spatial_merge_size=MERGE
    )
    h, bank_features = batch["h"], batch["bank_features"]
    full_embedding = gather_vision_rows(h.clone(), bank_features, global_bank)

    held = {}
    for balancer in BALANCERS:
        seen_masks = {}

        def post_process(input_dict, labels, balancer=balancer, seen_masks=seen_masks):
            # What upstream's Trainer.post_dataloading_process does for CP.
            inputs = input_dict["input"]
            extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
            masks = model.get_attention_masks(positions=extra_kwargs["positions"])
            seen_masks.update(masks)
            extra_kwargs["attention_masks"] = masks
            return prepare_context_parallel_input(
                inputs,
                labels,
                extra_kwargs,
                cp_mesh,
                torch.device("cpu"),
                balancer,
                "global",
            )

        pixel_values = torch.zeros(len(batch["grid_thw"]), 1, 1)
        input_dict = {
            "input": tokens.clone(),
            "positions": positions.clone(),
            "pixel_values": pixel_values,
            "grid_thw": batch["grid_thw"],
            "special_tokens": {"image_id": IMAGE},
        }
        labels = torch.arange(B * L).view(B, L)  # each token's global flat index
        local_tokens, local_labels, extra = post_process_with_vision_bank_indices(
            post_process,
            input_dict,
            labels,
            VisionGeometry(spatial_merge_size=MERGE, patch_dim=PATCH_DIM, vision_dim=8),
        )
        local_bank = extra["vision_bank_indices"]
        where = f"rank {rank}, cp={cp}, balancer={balancer}"

        assert set(seen_masks) == {"global", "swa_128"}, where
        assert local_tokens.shape == local_bank.shape == (B, L // cp), where
        assert local_bank.dtype == torch.long and local_bank.is_contiguous(), where
        assert extra["pixel_values"] is pixel_values, where
        for mask in extra["attention_masks"].values():
            assert mask.seq_lengths == (L // cp, L), where
        rows = torch.arange(B).unsqueeze(1)
        assert torch.equal(local_labels // L, rows.expand(B, L // cp)), where
        local_positions = local_labels % L  # global positions held here, per row

        assert torch.equal(local_tokens, tokens.gather(1, local_positions)), where
        assert torch.equal(extra["positions"], positions.gather(1, local_positions)), (
            where
        )
        assert torch.equal(local_tokens == IMAGE, local_bank >= 0), where
        assert torch.equal(local_bank, global_bank.gather(1, local_positions)), where
        index_BLD = local_positions.unsqueeze(-1).expand(-1, -1, DIM)
        local_embedding = gather_vision_rows(
            h.gather(1, index_BLD), bank_features, local_bank
        )
        assert torch.equal(local_embedding, full_embedding.gather(1, index_BLD)), where
        held[balancer] = {"positions": local_positions, "bank": local_bank}
    return held


def _expected_layout(balancer, cp: int, rank: int) -> torch.Tensor | None:
    if balancer is None:
        return torch.arange(rank * L // cp, (rank + 1) * L // cp)
    if balancer == "headtail":
        chunk = L // (2 * cp)
        head, tail = rank, 2 * cp - 1 - rank
        return torch.cat(
            [
                torch.arange(head * chunk, (head + 1) * chunk),
                torch.arange(tail * chunk, (tail + 1) * chunk),
            ]
        )
    return None  # ptrr: depends on the masks


def test_packed_batch_is_what_the_test_needs():
    from torchtitan_ext.muse_glimmer import check_vision_placeholders

    batch = _packed_batch()
    tokens = batch["input"]
    check_vision_placeholders(
        tokens, batch["grid_thw"], image_id=IMAGE, spatial_merge_size=MERGE
    )
    is_image = tokens == IMAGE
    assert bool(is_image[0, -1]), "row 0 must end inside an image"
    for row in range(B):
        for boundary in range(64, L, 64):
            assert bool(is_image[row, boundary - 1] & is_image[row, boundary])
        assert int((batch["positions"][row] == 0).sum()) >= 3  # several documents
    assert len(batch["grid_thw"]) >= 2 * 2 * 7


@pytest.mark.parametrize("cp", [2, 4])
def test_bank_indices_follow_tokens_through_cp_sharding(cp):
    batch = _packed_batch()
    held = run_on_ranks(_shard_on_rank, cp, cp, batch, timeout_s=TIMEOUT_S)

    from torchtitan_ext.muse_glimmer import build_vision_bank_indices

    global_bank = build_vision_bank_indices(
        batch["input"], batch["grid_thw"], image_id=IMAGE, spatial_merge_size=MERGE
    )
    is_image = global_bank >= 0
    after_image = torch.zeros_like(is_image)
    after_image[:, 1:] = is_image[:, :-1]
    run_of_row = torch.cumsum(is_image & ~after_image, dim=-1)  # per-row run ids
    for balancer in BALANCERS:
        positions = torch.stack([held[r][balancer]["positions"] for r in range(cp)])
        # The ranks' positions partition every row exactly once.
        for row in range(B):
            assert torch.equal(
                positions[:, row].flatten().sort().values, torch.arange(L)
            ), (cp, balancer, row)
        for rank in range(cp):
            expected = _expected_layout(balancer, cp, rank)
            if expected is not None:
                assert torch.equal(positions[rank], expected.expand(B, -1)), (
                    cp,
                    balancer,
                    rank,
                )
        # Some image has placeholders on two ranks (its span is split by CP).
        owner = torch.empty(B, L, dtype=torch.long)
        for rank in range(cp):
            owner.scatter_(1, positions[rank], rank)
        split_images = 0
        for row in range(B):
            row_is_image = is_image[row]
            for run in run_of_row[row][row_is_image].unique():
                in_run = row_is_image & (run_of_row[row] == run)
                split_images += int(owner[row][in_run].unique().numel() > 1)
        assert split_images >= 1, (cp, balancer)
        # Every bank row in use is gathered on exactly one rank.
        banks = torch.cat([held[r][balancer]["bank"].flatten() for r in range(cp)])
        assert torch.equal(
            banks[banks >= 0].sort().values, global_bank[is_image].sort().values
        ), (cp, balancer)
        if balancer == "ptrr":  # document-aware: the two rows are permuted apart
            assert not torch.equal(positions[:, 0], positions[:, 1]), cp
