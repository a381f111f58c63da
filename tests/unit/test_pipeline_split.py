"""A user's pipeline split gets the vision modules on stage 0, or a clear error."""

import pytest

from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS
from torchtitan_ext.muse_glimmer.pipeline import vision_on_first_stage

FIRST = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"]
LAST = ["layers.4", "layers.5", "layers.6", "layers.7", "norm", "lm_head"]


def test_omitted_vision_modules_go_first_on_stage_0():
    parts = vision_on_first_stage([FIRST, LAST], VISION_MODULE_FQNS)
    assert parts == [[*VISION_MODULE_FQNS, *FIRST], LAST]


def test_only_the_missing_ones_are_added():
    split = [["vision_adapter", *FIRST], LAST]
    parts = vision_on_first_stage(split, VISION_MODULE_FQNS)
    assert parts[0] == [
        "vision_encoder",
        "vision_projection",
        "perception_emb_norm",
        "vision_adapter",
        *FIRST,
    ]
    assert split[0] == ["vision_adapter", *FIRST]  # the user's list is not touched


def test_only_present_modules_are_placed():
    parts = vision_on_first_stage([FIRST, LAST], ("vision_projection",))
    assert parts[0] == ["vision_projection", *FIRST]


@pytest.mark.parametrize(
    ("split", "message"),
    [
        (
            [FIRST, ["vision_encoder", *LAST]],
            "puts 'vision_encoder' in part 1; muse_glimmer's vision modules",
        ),
        (
            [["vision_encoder.layers.0", *FIRST], LAST],
            "names 'vision_encoder.layers.0', a piece of 'vision_encoder'",
        ),
        (
            [FIRST[1:], ["tok_embeddings", *LAST]],
            "must put 'tok_embeddings' in its first part",
        ),
    ],
)
def test_misplaced_vision_modules_are_rejected(split, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        vision_on_first_stage(split, VISION_MODULE_FQNS)
