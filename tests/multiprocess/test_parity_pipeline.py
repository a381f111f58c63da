"""Pipeline parallelism on rows, steps and data ranks without images.

Settings as in ``parity_suites.py``: fp32 parameters, deterministic, the session's one
seed checkpoint, packed sequences. Each pipeline step runs two
microbatches of one packed row (``local_batch_size`` 2, microbatch size 1), so
the 1-rank baseline sees the same rows in the same step. The packed PP jobs
with images (PP2, CP2xPP2, TP2xCP2xPP2+SP) are in ``test_parity_cp.py``.
"""

from ..parity_suites import (
    STEPS,
    assert_passed,
    images_per_batch,
    run_suite,
    toml_spec,
)


def _no_image_data(assets) -> str:
    """Packed rows of 256 tokens: short enough that text-only runs fill whole rows."""
    return (
        f"--dataloader.dataset {assets.dataset} "
        f"--dataloader.dataset_path {assets.dataset_dir} --training.seq_len 256"
    )


def _images_per_row(assets, dp_world_size: int, dp_rank: int, rows: int) -> list[int]:
    """Images in each packed row one DP rank trains on, in order (microbatch 1)."""
    return images_per_batch(
        assets,
        seq_len=256,
        local_batch_size=1,
        batches=rows,
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
    )


def test_without_images_cp2_pp2_and_fsdp2_pp2(
    tmp_path, no_image_assets, seed_checkpoint
):
    """Rows, steps and DP ranks without images: no hang, same numbers.

    CP2xPP2 and TP2+CP2+SP (typechecked) are compared with 1 rank; FSDP2xPP2
    with FSDP2: two DP ranks read different shards, which no 1-rank run
    reproduces.
    """
    one_rank = _images_per_row(no_image_assets, 1, 0, 2 * STEPS)
    per_step = [one_rank[i] + one_rank[i + 1] for i in range(0, 2 * STEPS, 2)]
    assert 0 in one_rank and max(one_rank) > 0, one_rank
    assert 0 in per_step, f"no step without images in {one_rank}"
    dp_ranks = [_images_per_row(no_image_assets, 2, rank, 2 * STEPS) for rank in (0, 1)]
    assert any((a == 0) != (b == 0) for a, b in zip(*dp_ranks, strict=True)), dp_ranks
    no_image_data = _no_image_data(no_image_assets)

    results = run_suite(
        tmp_path,
        "without_images",
        toml_spec("packed.toml", no_image_data),
        {
            "cp2_pp2": toml_spec("cp2_pp2.toml", no_image_data),
            # The blank image under spmd typechecking with TP > 1.
            "tp2_cp2_sp_typechecked": toml_spec(
                "tp2_cp2_sp_typechecked.toml", no_image_data
            ),
        },
        seed_checkpoint=seed_checkpoint,
    )
    results |= run_suite(
        tmp_path,
        "without_images_fsdp2",
        toml_spec("fsdp2.toml", no_image_data),
        {"fsdp2_pp2": toml_spec("fsdp2_pp2.toml", no_image_data)},
        seed_checkpoint=seed_checkpoint,
    )
    assert_passed(results)
