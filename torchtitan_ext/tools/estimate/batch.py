"""The planner's synthetic batch: rows of text with evenly spaced square images,
laid out as ``benchmarks/memory_per_rank.py``'s. Values do not change memory:
tokens are random below the placeholder id (the vocabulary's last entry, so no
tokenizer is needed); pixels are zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_ext.muse_glimmer.batch_agreement import SAMPLE_DIGESTS

__all__ = ["ImageSize", "image_size", "synthetic_batch"]


@dataclass(frozen=True)
class ImageSize:
    tokens: int  # placeholders (feature-bank rows): (side / merge)**2
    side_patches: int  # patches per side
    patch_size: int  # pixels per patch side

    def __str__(self) -> str:
        side, pixels = self.side_patches, self.side_patches * self.patch_size
        return (
            f"{pixels}x{pixels} px ({side}x{side} patches of "
            f"{self.patch_size} px, {self.tokens} tokens)"
        )


def image_size(
    encoder_config, *, seq_len: int, images: int, tokens_per_image: int | None
) -> ImageSize:
    """``tokens_per_image`` (a square), or by default the encoder's native grid
    (448 px for 30B_mm), shrunk until the images fill at most half of a row."""
    merge = encoder_config.downsample_factor
    if tokens_per_image is None:
        native = min(encoder_config.pos_emb_grid_h, encoder_config.pos_emb_grid_w)
        side = max(1, min(native // merge, math.isqrt(seq_len // (2 * images))))
        tokens_per_image = side * side
    side = math.isqrt(tokens_per_image)
    if side * side != tokens_per_image:
        raise ValueError(f"tokens per image must be a square; got {tokens_per_image}")
    if images < 1 or tokens_per_image >= seq_len // images:
        raise ValueError(
            f"{images} images of {tokens_per_image} tokens do not fit a row of "
            f"{seq_len} tokens, one image per {seq_len // max(images, 1)} tokens"
        )
    return ImageSize(tokens_per_image, side * merge, encoder_config.patch_size)


def synthetic_batch(
    model_config, *, rows: int, seq_len: int, images: int, size: ImageSize
) -> tuple[dict[str, Any], torch.Tensor]:
    """A CPU batch as the dataloader yields it: ``rows`` rows, ``images`` each."""
    from torchtitan.components.loss import IGNORE_INDEX

    encoder = model_config.vision_encoder
    image_id = model_config.vocab_size - 1
    generator = torch.Generator().manual_seed(0)
    tokens_BL = torch.randint(0, image_id, (rows, seq_len + 1), generator=generator)
    stride = seq_len // images
    for image in range(images):
        start = image * stride + 1
        tokens_BL[:, start : start + size.tokens] = image_id
    labels_BL = tokens_BL[:, 1:].clone()
    labels_BL[labels_BL == image_id] = IGNORE_INDEX
    patches = size.side_patches
    input_dict = {
        "input": tokens_BL[:, :-1],
        "positions": torch.arange(seq_len).expand(rows, seq_len).clone(),
        "pixel_values": torch.zeros(
            rows * images, patches * patches, encoder.conv1.in_features
        ),
        "grid_thw": torch.tensor([[1, patches, patches]] * (rows * images)),
        "special_tokens": {"image_id": image_id},
        SAMPLE_DIGESTS: torch.arange(rows * images),  # one caption per image
    }
    return input_dict, labels_BL
