"""A batch without images still runs the vision modules, without changing results."""

import pytest
import torch
from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
from torchtitan.models.muse_glimmer import model_registry as upstream_model_registry

from torchtitan_ext.muse_glimmer import (
    VisionGeometry,
    model_registry,
    post_process_with_vision_bank_indices,
)

IMAGE_ID = 4
VISION_PREFIXES = ("vision_encoder.", "vision_adapter.", "vision_projection.")


@pytest.fixture(autouse=True)
def _untyped():
    """One process, no device mesh: skip the spmd_types annotations."""
    previous = get_spmd_backend()
    set_spmd_backend("full_dtensor")
    yield
    set_spmd_backend(previous)


def _models():
    upstream = upstream_model_registry("debugmodel_mm").model.build()
    plugin = model_registry("debugmodel_mm").model.build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in upstream.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)
    plugin.load_state_dict(upstream.state_dict(), strict=True)
    return upstream, plugin


def test_text_only_batch_gives_zero_vision_gradients_and_upstream_output():
    upstream, plugin = _models()
    generator = torch.Generator().manual_seed(1)
    tokens_BL = torch.randint(8, 35, (2, 64), generator=generator)
    positions_BL = torch.arange(64).expand(2, 64)
    input_dict = {
        "input": tokens_BL,
        "positions": positions_BL,
        "pixel_values": None,
        "grid_thw": None,
        "special_tokens": {"image_id": IMAGE_ID},
    }
    masks = {"attention_masks": upstream.get_attention_masks(positions=positions_BL)}

    def post_process(inputs, labels):  # upstream's, without CP and typing
        return (
            inputs["input"],
            labels,
            {k: v for k, v in inputs.items() if k != "input"},
        )

    tokens, _, kwargs = post_process_with_vision_bank_indices(
        post_process, input_dict, tokens_BL, VisionGeometry.of(plugin.config)
    )
    assert torch.equal(tokens, tokens_BL)
    assert (kwargs["vision_bank_indices"] == -1).all()
    assert kwargs["pixel_values"].shape[0] == 1 and not kwargs["pixel_values"].any()

    expected = upstream(
        tokens_BL, **{k: v for k, v in input_dict.items() if k != "input"}, **masks
    )
    got = plugin(tokens, **kwargs, **masks)
    assert torch.equal(got, expected)
    expected.square().mean().backward()
    got.square().mean().backward()

    ours = dict(plugin.named_parameters())
    vision = 0
    for name, param in upstream.named_parameters():
        if name.startswith(VISION_PREFIXES):
            assert param.grad is None, name  # upstream skips the vision modules
            assert ours[name].grad is not None, name
            assert not ours[name].grad.any(), name
            vision += 1
        elif param.grad is not None:
            assert torch.equal(ours[name].grad, param.grad), name
    assert vision > 20
