"""The plug-in's model against transformers' muse_glimmer, on one rank.

Both load one Hugging Face checkpoint (``tools.hf_checkpoint``: seeded
weights, constant-initialised ones drawn, so logits are far from 0): the
plug-in through torchtitan's state-dict adapter, transformers with
``from_pretrained``. Forward only, fp32, on ``hf_reference.BATCHES``. The
bounds are set from the measured floor (below) and must still catch the
smallest injection bug, one image's rows off by one.
"""

import functools

import pytest
import torch
from safetensors.torch import load_file
from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
from torchtitan.models.muse_glimmer.state_dict_adapter import (
    MuseGlimmerStateDictAdapter,
)
from torchtitan.models.muse_glimmer.vision_encoder import (
    MuseGlimmerVisionEncoder as UpstreamEncoder,
)

from torchtitan_ext.muse_glimmer import (
    VisionGeometry,
    model_registry,
    post_process_with_vision_bank_indices,
)
from torchtitan_ext.muse_glimmer import trainer as plugin_trainer
from torchtitan_ext.tools.hf_checkpoint import seeded_state_dict, write_hf_checkpoint

from ..hf_reference import (
    BATCHES,
    SEQ_LEN,
    caption_loss,
    hf_logits,
    make_batch,
    plant_rows_off_by_one,
    relative_error,
)

# Measured floor (fp32): max |dlogit| / max |logit| 3.9e-5 .. 6.8e-5 and |dloss|
# 9.5e-7 .. 1.4e-6 over the batches (transformers' eager against its own sdpa
# kernel: 6e-5 .. 1e-4). One image's rows off by one: 0.80 and (below).
LOGIT_REL_TOL = 3e-4
LOSS_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf"), seeded_state_dict(0))


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    from transformers import MuseGlimmerForConditionalGeneration

    reference = MuseGlimmerForConditionalGeneration.from_pretrained(
        hf_checkpoint, attn_implementation="eager"
    ).eval()
    plugin = model_registry("debugmodel_mm").model.build()
    adapter = MuseGlimmerStateDictAdapter(plugin.config, None)
    hf_state = load_file(hf_checkpoint / "model.safetensors")
    plugin.init_weights()  # buffers (rope caches); the weights are replaced
    plugin.load_state_dict(adapter.from_hf(hf_state), strict=True)
    return plugin.eval(), reference


@pytest.fixture(autouse=True)
def _no_device_mesh():
    """One process, no device mesh: skip the spmd_types annotations."""
    previous = get_spmd_backend()
    set_spmd_backend("full_dtensor")
    yield
    set_spmd_backend(previous)


@torch.no_grad()
def plugin_logits(model, batch) -> torch.Tensor:
    tokens, _, kwargs = post_process_with_vision_bank_indices(
        lambda inputs, labels: (
            inputs["input"],
            labels,
            {k: v for k, v in inputs.items() if k != "input"},
        ),
        batch["input_dict"],
        batch["labels"],
        VisionGeometry.of(model.config),
    )
    masks = model.get_attention_masks(positions=kwargs["positions"])
    return model(tokens, **kwargs, attention_masks=masks)


@pytest.mark.parametrize("name", list(BATCHES))
def test_logits_and_loss_match_transformers(models, name):
    plugin, reference = models
    batch = make_batch(name)
    want = hf_logits(reference, batch["hf_rows"])
    got = plugin_logits(plugin, batch)
    error = relative_error(got, want)
    dloss = abs(
        caption_loss(got, batch["labels"]) - caption_loss(want, batch["labels"])
    )
    print(
        f"{name}: max|dlogit|/max|logit|={error:.2e} |dloss|={dloss:.2e} "
        f"max|logit|={want.abs().max():.2f}"
    )
    assert error <= LOGIT_REL_TOL and dloss <= LOSS_TOL


def _non_square_error(plugin, reference) -> tuple[float, float]:
    batch = make_batch("non_square_packed")
    want = hf_logits(reference, batch["hf_rows"])
    got = plugin_logits(plugin, batch)
    dloss = caption_loss(got, batch["labels"]) - caption_loss(want, batch["labels"])
    return relative_error(got, want), abs(dloss.item())


def test_an_image_off_by_one_row_is_caught(models, monkeypatch):
    plugin, reference = models
    monkeypatch.setattr(
        plugin_trainer,
        "build_vision_bank_indices",
        plugin_trainer.build_vision_bank_indices,
    )
    plant_rows_off_by_one(plugin_trainer)
    error, dloss = _non_square_error(plugin, reference)
    print(f"rows off by one: max|dlogit|/max|logit|={error:.2e} |dloss|={dloss:.2e}")
    assert error > LOGIT_REL_TOL and dloss > LOSS_TOL


def test_torchtitan_030_position_grid_is_caught(models, monkeypatch):
    """Without the #4244 backport the non-square batch is far off transformers."""
    plugin, reference = models
    encoder = plugin.vision_encoder
    monkeypatch.setattr(
        encoder,
        "_get_pos_emb",
        functools.partial(UpstreamEncoder._get_pos_emb, encoder),
    )
    error, dloss = _non_square_error(plugin, reference)
    print(f"0.3.0 resampler: max|dlogit|/max|logit|={error:.2e} |dloss|={dloss:.2e}")
    assert error > LOGIT_REL_TOL and dloss > LOSS_TOL


def test_transformers_rejects_the_cut_image_the_plugin_reads(models):
    """Cut by the end of its row, the image's placeholders are fewer than its
    features: transformers refuses the row; the plug-in gathers the rows that
    fit, which causal attention makes the uncut row's prefix (compared above)."""
    _, reference = models
    row = make_batch("unpacked_with_cut_image")["hf_rows"][1]
    cut = {key: value[:, :SEQ_LEN] for key, value in row.items() if "ids" in key}
    with pytest.raises(ValueError, match="Image features and image tokens do not"):
        reference(
            **cut,
            pixel_values=row["pixel_values"],
            image_grid_thw=row["image_grid_thw"],
            use_cache=False,
        )
