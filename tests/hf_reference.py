"""transformers' muse_glimmer as the independent reference of the plug-in's forward.

The same weights (a Hugging Face checkpoint from ``tools.hf_checkpoint``) and
the same images reach both sides by their own paths: the plug-in gets
torchtitan's collator layout (``vision_to_patches``, padded ``[N, P, D]``),
transformers its own image processor's output. ``BATCHES`` are fixed batches
of two 512-token rows (CP4's smallest length): several images of different
sizes, square and not, packed rows of several documents (positions restart)
and unpacked rows (one document, then padding), and an image cut by the end
of its row. transformers rejects the cut image (its placeholder count must
equal its features); causal attention makes the right answer the uncut
row's prefix, which is what it is compared with here.
"""

import torch
import torch.nn.functional as F
from torchtitan.hf_datasets.multimodal.utils.image import vision_to_patches

from torchtitan_ext.embedded_data import SPECIAL_TOKENS

__all__ = [
    "BATCHES",
    "SEQ_LEN",
    "caption_loss",
    "hf_logits",
    "make_batch",
    "plant_rows_off_by_one",
    "relative_error",
]

SEQ_LEN = 512
PATCH, TEMPORAL, MERGE = 14, 2, 2
IMAGE_ID = SPECIAL_TOKENS.index("<|image_pad|>")
VISION_START = SPECIAL_TOKENS.index("<|vision_start|>")
VISION_END = SPECIAL_TOKENS.index("<|vision_end|>")
PAD_ID = SPECIAL_TOKENS.index("<|endoftext|>")
_FIRST_WORD_ID = len(SPECIAL_TOKENS)

# A row: documents; a document: ("text", n) and ("image", h, w) segments
# (h, w in patches). A row's last image may be cut by SEQ_LEN.
BATCHES = {
    "square": [
        [[("text", 20), ("image", 4, 4), ("text", 60)], [("text", 30)]],
        [[("image", 2, 2), ("text", 200), ("image", 6, 6), ("text", 100)]],
    ],
    "non_square_packed": [
        [
            [("text", 10), ("image", 4, 8), ("text", 30)],
            [("image", 10, 6), ("text", 150)],
        ],
        [
            [("image", 6, 6), ("text", 60), ("image", 8, 4)],
            [("text", 100), ("image", 2, 6)],
        ],
    ],
    "unpacked_with_cut_image": [
        [[("text", 40), ("image", 8, 4), ("text", 20)]],  # then padding
        [[("text", 500), ("image", 10, 6)]],  # 11 of its 15 placeholders fit
    ],
}


def _images(rows, generator):
    return [
        torch.randint(
            0,
            256,
            (3, PATCH * seg[1], PATCH * seg[2]),
            generator=generator,
            dtype=torch.uint8,
        )
        for row in rows
        for document in row
        for seg in document
        if seg[0] == "image"
    ]


def _tokens(document, generator) -> list[int]:
    tokens = []
    for seg in document:
        if seg[0] == "text":
            words = torch.randint(_FIRST_WORD_ID, 2048, (seg[1],), generator=generator)
            tokens += words.tolist()
        else:
            tokens += [VISION_START, *[IMAGE_ID] * (seg[1] * seg[2] // 4), VISION_END]
    return tokens


def make_batch(name: str, seed: int = 0) -> dict:
    """Batch ``name`` of ``BATCHES``: the plug-in's inputs and transformers' rows.

    ``input_dict``/``labels`` are the collator's (labels: the next token, -100
    for padding and placeholders); ``hf_rows`` one transformers input per row,
    uncut (longer than ``SEQ_LEN`` where an image is cut).
    """
    generator = torch.Generator().manual_seed(seed)
    rows = BATCHES[name]
    images = _images(rows, generator)
    full_rows, position_rows = [], []
    for row in rows:
        tokens, positions = [], []
        for document in row:
            document_tokens = _tokens(document, generator)
            tokens += document_tokens
            positions += list(range(len(document_tokens)))
        if len(tokens) < SEQ_LEN:  # unpacked: padding continues the document
            positions += range(
                positions[-1] + 1, positions[-1] + 1 + SEQ_LEN - len(tokens)
            )
            tokens += [PAD_ID] * (SEQ_LEN - len(tokens))
        full_rows.append(torch.tensor(tokens))
        position_rows.append(torch.tensor(positions))
    tokens_BL = torch.stack([row[:SEQ_LEN] for row in full_rows])
    positions_BL = torch.stack([row[:SEQ_LEN] for row in position_rows])
    labels_BL = torch.cat([tokens_BL[:, 1:], torch.full((len(rows), 1), PAD_ID)], 1)
    labels_BL[(labels_BL == PAD_ID) | (labels_BL == IMAGE_ID)] = -100
    grid_thw_N3 = torch.tensor(
        [[1, im.shape[1] // PATCH, im.shape[2] // PATCH] for im in images]
    )
    return {
        "input_dict": {
            "input": tokens_BL,
            "positions": positions_BL,
            "pixel_values": _titan_pixels(images),
            "grid_thw": grid_thw_N3,
            "special_tokens": {"image_id": IMAGE_ID},
        },
        "labels": labels_BL,
        "hf_rows": _hf_rows(full_rows, position_rows, images),
    }


def _normalized(image):
    return (image.float() / 255.0 - 0.5) / 0.5  # torchtitan's mean and std 0.5


def _titan_pixels(images) -> torch.Tensor:
    """The collator's layout: raster patches, zero-padded to ``[N, P, D]``."""
    patches = [
        vision_to_patches(
            _normalized(im).permute(1, 2, 0)[None],
            PATCH,
            TEMPORAL,
            MERGE,
            patch_order="raster",
        )[0]
        for im in images
    ]
    padded_NPD = torch.zeros(
        len(patches), max(p.shape[0] for p in patches), patches[0].shape[1]
    )
    for i, patches_PD in enumerate(patches):
        padded_NPD[i, : patches_PD.shape[0]] = patches_PD
    return padded_NPD


def _hf_rows(full_rows, position_rows, images) -> list[dict]:
    """Per row, what transformers' processor and model take, images whole."""
    from transformers.models.muse_glimmer.image_processing_muse_glimmer import (
        MuseGlimmerImageProcessor,
    )

    processor = MuseGlimmerImageProcessor()
    hf_rows, first = [], 0
    for tokens, positions in zip(full_rows, position_rows, strict=True):
        count = int((tokens == VISION_START).sum())
        row = {"input_ids": tokens[None], "position_ids": positions[None]}
        if count:
            processed = processor(
                images=images[first : first + count],
                do_resize=False,
                return_tensors="pt",
            )
            row |= {
                "pixel_values": processed["pixel_values"],
                "image_grid_thw": processed["image_grid_thw"],
            }
        hf_rows.append(row)
        first += count
    return hf_rows


@torch.no_grad()
def hf_logits(model, hf_rows) -> torch.Tensor:
    """transformers' logits ``[B, SEQ_LEN, V]``, each row run whole, then cut.

    ``use_cache=False``: only then does transformers build its block-causal
    mask for packed rows from the restarting positions.
    """
    return torch.cat(
        [model(**row, use_cache=False).logits[:, :SEQ_LEN] for row in hf_rows]
    )


def caption_loss(logits_BLV: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions, in float32."""
    return F.cross_entropy(
        logits_BLV.float().flatten(0, 1), labels_BL.flatten(), ignore_index=-100
    )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want|."""
    return ((got - want).abs().max() / want.abs().max()).item()


def plant_rows_off_by_one(trainer_module) -> None:
    """The smallest injection bug: the first image's tokens read its next row.

    Patches ``trainer_module.build_vision_bank_indices`` (the plug-in's
    ``muse_glimmer.trainer``): the first image's placeholders gather its rows
    rotated by one, every other image's are right.
    """
    from .planted_bugs import patch_bank_indices

    def off_by_one(indices_BL, tokens_BL, grid_thw_N3, merge) -> None:
        rows = int(grid_thw_N3[0].prod()) // merge**2
        first = (indices_BL >= 0) & (indices_BL < rows)
        indices_BL[first] = (indices_BL[first] + 1) % rows

    patch_bank_indices(trainer_module, off_by_one)
