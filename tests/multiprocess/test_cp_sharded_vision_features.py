"""Sharded vision on 4 real CP ranks: every image's features as one process's.

Each rank runs the plug-in's preprocessing and model forward on the same
unsharded batch (no load balancing, so every rank embeds the whole sequence
and only the vision path is distributed): its share of the images is encoded,
projected and normed, the rows exchanged, and every placeholder's row written
into the embeddings. The embeddings entering the first decoder layer must
equal one process's image by image within float32 rounding, and bitwise in
replicated mode. Which images come out bitwise depends on the shapes a share
gives the matmuls: measured in one process, an image's features are bitwise
unless its share's encoder batch has fewer than 16 patch rows or its
adapter batch 3 rows or fewer (here the share of images 5 and 6), where the
CPU's BLAS takes another kernel (other blocking, other rounding)"""

import pytest
import torch

from torchtitan_ext.tools.local_ranks import run_on_ranks

CP = 4
TIMEOUT_S = 300
# (t, h, w) patch grids: uneven sizes, one much larger than the rest.
GRIDS = [[1, 2, 2], [1, 4, 4], [1, 2, 4], [1, 12, 12], [1, 6, 4], [1, 2, 2], [1, 4, 2]]
SEQ_LEN = 512
# |sharded - one process| per image, relative to the largest embedding entry:
# measured at most 3.3e-7 (images 5 and 6); a wrong or shifted row is O(1).
FEATURE_REL_TOL = 1e-5


def _job(mode: str, cp: int):
    from ..jobs import train_config

    job = train_config("cp4.toml")
    job.parallelism.context_parallel_degree = cp
    job.parallelism.context_parallel_vision = mode
    job.model_spec.model.update_from_config(config=job)
    return job


def _batch(model_config, special_tokens: dict):
    """One row: text with each image's placeholder run, and the images."""
    from torchtitan_ext.muse_glimmer import VisionGeometry

    geometry = VisionGeometry.of(model_config)
    image_id = special_tokens["image_id"]
    merge = geometry.spatial_merge_size
    generator = torch.Generator().manual_seed(0)
    tokens_1L = torch.randint(10, 200, (1, SEQ_LEN), generator=generator)
    start = 3
    for t, h, w in GRIDS:
        rows = t * h * w // merge**2
        tokens_1L[0, start : start + rows] = image_id
        start += rows + 5
    assert start < SEQ_LEN
    patches = [t * h * w for t, h, w in GRIDS]
    pixel_values = torch.zeros(len(GRIDS), max(patches), geometry.patch_dim)
    for image, n in enumerate(patches):
        pixel_values[image, :n] = torch.randn(
            n, geometry.patch_dim, generator=generator
        )
    input_dict = {
        "input": tokens_1L,
        "pixel_values": pixel_values,
        "grid_thw": torch.tensor(GRIDS),
        "special_tokens": special_tokens,
    }
    return input_dict, tokens_1L.clone()


def _embeddings(model, input_dict, labels, geometry, share_of=None) -> torch.Tensor:
    """The model's forward as the Trainer runs it; the first layer's input."""
    from torchtitan_ext.muse_glimmer import post_process_with_vision_bank_indices

    if share_of is not None:
        input_dict = {**input_dict, "cp_vision_share": share_of(input_dict["grid_thw"])}

    def without_cp_sharding(inputs, labels):
        kwargs = {k: v for k, v in inputs.items() if k != "input"}
        return inputs["input"], labels, kwargs

    tokens, _, kwargs = post_process_with_vision_bank_indices(
        without_cp_sharding, input_dict, labels, geometry
    )
    captured = {}

    def stop_at_first_layer(_, args):
        captured["h"] = args[0].detach().clone()
        raise _EmbeddingsReady

    first_layer = next(iter(model.layers.values()))
    hook = first_layer.register_forward_pre_hook(stop_at_first_layer)
    try:
        with torch.no_grad():
            model(tokens, **kwargs)
    except _EmbeddingsReady:
        pass
    finally:
        hook.remove()
    return captured["h"]


class _EmbeddingsReady(Exception):
    """Ends the forward at the first decoder layer: the rest is not compared."""


def _weights_and_batch():
    """The debug model's initial weights and one batch (image id 1)."""
    job = _job("replicated", 1)
    torch.manual_seed(0)
    model = job.model_spec.model.build()
    with torch.no_grad():
        model.init_states()
    input_dict, labels = _batch(job.model_spec.model, {"image_id": 1})
    return model.state_dict(), input_dict, labels


def _on_cp_rank(state_dict, input_dict, labels, modes) -> dict:
    """Each mode's first-layer input and share on this rank of a cp-only world."""
    import functools

    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from torchtitan_ext.muse_glimmer import VisionGeometry, cp_vision_share

    torch.set_num_threads(1)  # on every rank: bitwise needs the same reductions
    cp = dist.get_world_size()
    results = {}
    for mode in modes:
        job = _job(mode, cp)
        model = job.model_spec.model.build()
        model.load_state_dict(state_dict)
        dist_utils.set_spmd_backend(job.parallelism.spmd_backend)
        parallel_dims = ParallelDims.from_config(job.parallelism, cp)
        parallel_dims.build_mesh()
        model.parallelize(parallel_dims)
        geometry = VisionGeometry.of(job.model_spec.model)
        share_of = functools.partial(
            cp_vision_share,
            cp_degree=cp,
            cp_rank=dist.get_rank(),
            spatial_merge_size=geometry.spatial_merge_size,
            vision_dim=geometry.vision_dim,
        )
        context = dist_utils.get_spmd_context(
            parallel_dims=parallel_dims, spmd_typechecking=False
        )
        with context():
            results[mode] = _embeddings(
                model,
                input_dict,
                labels,
                geometry,
                share_of if mode == "sharded" else None,
            )
        results[f"{mode}_share"] = share_of(input_dict["grid_thw"])
    return results


@pytest.fixture(scope="module")
def cp4_runs():
    """One process's embeddings, and each CP4 rank's in both vision modes."""
    state_dict, input_dict, labels = _weights_and_batch()
    (reference,) = run_on_ranks(
        _on_cp_rank,
        1,
        state_dict,
        input_dict,
        labels,
        ["replicated"],
        timeout_s=TIMEOUT_S,
    )
    results = run_on_ranks(
        _on_cp_rank,
        CP,
        state_dict,
        input_dict,
        labels,
        ["replicated", "sharded"],
        timeout_s=TIMEOUT_S,
    )
    return input_dict, reference["replicated"], results


def _image_rows(input_dict) -> list[torch.Tensor]:
    """Each image's placeholder positions in the row, image by image."""
    positions_N = (input_dict["input"][0] == 1).nonzero().flatten()
    rows = [t * h * w // 4 for t, h, w in GRIDS]
    return list(torch.split(positions_N, rows))


def test_replicated_ranks_embed_like_one_process(cp4_runs):
    _, reference_1LD, results = cp4_runs
    for rank, result in enumerate(results):
        assert torch.equal(result["replicated"], reference_1LD), rank


def test_sharded_ranks_embed_every_image_like_one_process(cp4_runs):
    input_dict, reference_1LD, results = cp4_runs
    shares = [result["sharded_share"].image_range for result in results]
    # The large image alone on a rank; every rank holds some images.
    assert all(stop > start for start, stop in shares), shares
    assert (3, 4) in shares, shares
    scale = reference_1LD.abs().max()
    text = (input_dict["input"][0] != 1).nonzero().flatten()
    for rank, result in enumerate(results):
        h_1LD = result["sharded"]
        assert torch.equal(h_1LD[0, text], reference_1LD[0, text]), rank
        for image, positions in enumerate(_image_rows(input_dict)):
            got, want = h_1LD[0, positions], reference_1LD[0, positions]
            error = float((got - want).abs().max() / scale)
            owner = next(r for r, (a, b) in enumerate(shares) if a <= image < b)
            print(
                f"rank {rank} image {image} (grid {GRIDS[image]}, encoded on rank "
                f"{owner}): {'bitwise' if torch.equal(got, want) else f'{error:.1e}'}"
            )
            assert error <= FEATURE_REL_TOL, (rank, image, error)
