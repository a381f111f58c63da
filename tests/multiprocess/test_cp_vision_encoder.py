"""Under CP the vision encoder runs replicated: a CP2 rank encodes as one rank does.

The encoder is built from the plug-in's CP2 job (``update_from_config`` sets the
CP vision sharding), parallelized on a real 2-rank cp mesh and run under the
trainer's spmd context with type checking, on inputs typed as the plug-in's
model types them. Its output must equal, bitwise, the same encoder's output
in this (single, non-distributed) process. The negative control puts back
upstream's decoder-style inner-attention layout, which all-gathers k/v over
cp: then every image would attend to cp copies of its own patches, which type
checking refuses and, without it, FlexAttention's P x P mask does.
"""

import pytest
import torch

from torchtitan_ext.tools.local_ranks import run_on_ranks

CP = 2
TIMEOUT_S = 300
# (t, h, w) patch grids, h and w divisible by the downsample factor 2; the
# largest spans several 2x2 attention windows.
GRIDS = [[1, 2, 2], [1, 4, 4], [1, 2, 4], [1, 6, 4]]


def _encoder_config(layout: str):
    """The plug-in's CP2 vision encoder config; ``layout="upstream"``: decoder-style."""
    from torchtitan.models.common.decoder_sharding import (
        set_gqa_inner_attention_local_map,
    )

    from ..jobs import train_config

    job = train_config("cp2.toml")
    model_config = job.model_spec.model
    model_config.update_from_config(config=job)
    encoder_config = model_config.vision_encoder
    if layout == "upstream":
        set_gqa_inner_attention_local_map(encoder_config.block.attn.inner_attention)
    return job, encoder_config


def _inputs(encoder_config, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded random ``pixel_values`` ``[N, P, patch_dim]`` and ``grid_thw``."""
    generator = torch.Generator().manual_seed(seed)
    patch_dim = 3 * encoder_config.patch_temporal * encoder_config.patch_size**2
    grid_thw = torch.tensor(GRIDS)
    num_patches = grid_thw.prod(-1)
    pixel_values = torch.zeros(len(GRIDS), int(num_patches.max()), patch_dim)
    for image, n in enumerate(num_patches.tolist()):
        pixel_values[image, :n] = torch.randn(n, patch_dim, generator=generator)
    return pixel_values, grid_thw


def _reference(seed: int = 0):
    """Weights, inputs and the output of the encoder in this single process."""
    _, encoder_config = _encoder_config("plugin")
    torch.manual_seed(seed)
    encoder = encoder_config.build()
    with torch.no_grad():
        encoder.init_states()
    pixel_values, grid_thw = _inputs(encoder_config, seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: bitwise needs the same reductions
    try:
        with torch.no_grad():
            output = encoder(pixel_values, grid_thw=grid_thw)
    finally:
        torch.set_num_threads(threads)
    return encoder.state_dict(), pixel_values, grid_thw, output


def _encode_on_cp_rank(layouts, state_dict, pixel_values, grid_thw) -> dict:
    """``{layout: _encode_with_layout(layout, ...)}`` on this rank."""
    torch.set_num_threads(1)  # as the reference
    return {
        layout: _encode_with_layout(layout, state_dict, pixel_values, grid_thw)
        for layout in layouts
    }


def _encode_with_layout(layout: str, state_dict, pixel_values, grid_thw) -> dict:
    """Build, load, parallelize on the cp mesh, run as the trainer does.

    Once with spmd type checking (``debug.spmd_typechecking``) and once without
    (the default), each on a freshly built and parallelized encoder.
    """
    import traceback

    import spmd_types as spmd
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.multimodal import multimodal_context

    from torchtitan_ext.muse_glimmer.sharding import VISION_INPUT_TYPE

    job, encoder_config = _encoder_config(layout)
    dist_utils.set_spmd_backend(job.parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(job.parallelism, dist.get_world_size())
    assert parallel_dims.cp == CP and parallel_dims.cp_enabled
    parallel_dims.build_mesh()

    results = {}
    for typechecking in (True, False):
        encoder = encoder_config.build()
        encoder.load_state_dict(state_dict)
        if typechecking:
            with torch.no_grad():  # the same module, not parallelized
                results["local"] = encoder(pixel_values, grid_thw=grid_thw)
        encoder.parallelize(parallel_dims)
        context = dist_utils.get_spmd_context(
            parallel_dims=parallel_dims, spmd_typechecking=typechecking
        )
        try:
            with context(), multimodal_context(), torch.no_grad():
                for tensor in (pixel_values, grid_thw):
                    spmd.assert_type(tensor, VISION_INPUT_TYPE)
                output = encoder(pixel_values, grid_thw=grid_thw)
        except Exception:  # the negative control may fail here
            results[typechecking] = traceback.format_exc()
        else:
            results[typechecking] = output.detach().clone()  # without spmd types
    return results


@pytest.fixture(scope="module")
def cp2_runs():
    """Both layouts on the same 2 ranks (one start-up), and the 1-rank output."""
    state_dict, pixel_values, grid_thw, expected = _reference()
    results = run_on_ranks(
        _encode_on_cp_rank,
        CP,
        ("plugin", "upstream"),
        state_dict,
        pixel_values,
        grid_thw,
        timeout_s=TIMEOUT_S,
    )
    for rank, result in enumerate(results):
        for layout in ("plugin", "upstream"):
            assert torch.equal(result[layout]["local"], expected), (rank, layout)
    return expected, results


def test_cp2_rank_encodes_like_one_rank(cp2_runs):
    expected, results = cp2_runs
    assert expected.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 256)
    for rank, result in enumerate(results):
        for typechecking in (True, False):
            output = result["plugin"][typechecking]
            assert isinstance(output, torch.Tensor), (rank, typechecking, output)
            assert torch.equal(output, expected), (rank, typechecking)


def test_upstream_vision_attention_layout_mixes_cp_ranks(cp2_runs):
    _, results = cp2_runs
    for rank, result in enumerate(results):
        result = result["upstream"]
        # With type checking, the cp all-gather of replicated k/v is refused...
        assert isinstance(result[True], str), rank
        assert "SpmdTypeError" in result[True], (rank, result[True])
        # ...without it (the default), k/v are all-gathered over cp, so every image
        # would attend to cp copies of its patches: cp * P keys against a P mask.
        assert isinstance(result[False], str), (rank, result[False])
        assert "block_mask was created for a smaller length" in result[False], (
            rank,
            result[False],
        )
