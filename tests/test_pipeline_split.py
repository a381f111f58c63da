"""A user's pipeline split gets the vision modules on stage 0, or a clear error."""

import pytest

from torchtitan_ext.muse_glimmer.model import VISION_MODULE_FQNS
from torchtitan_ext.muse_glimmer.pipeline import vision_on_first_stage

from .training_runs import REPO, run_train

FIRST = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"]
LAST = ["layers.4", "layers.5", "layers.6", "layers.7", "norm", "lm_head"]
TIMEOUT_S = 600


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


def _split_toml(path, first, last):
    def fqns(part):
        return ", ".join(f'"{fqn}"' for fqn in part)

    path.write_text(
        (REPO / "train_configs" / "pp2.toml").read_text()
        + f"module_fqns_per_model_part = [[{fqns(first)}], [{fqns(last)}]]\n"
    )
    return path


def test_pp2_run_places_omitted_vision_modules(tmp_path):
    toml = _split_toml(tmp_path / "split.toml", FIRST, LAST)
    args = ["--training.steps=2", "--training.seq_len=256"]
    run_train(
        tmp_path,
        "placed",
        2,
        str(toml),
        args,
        timeout_s=TIMEOUT_S,
        env={"LOG_RANK": "0,1"},
    )
    log = (tmp_path / "placed.log").read_text()
    assert f"Placing {list(VISION_MODULE_FQNS)} on the first pipeline stage" in log
    assert "step:  2" in log


def test_pp2_run_rejects_vision_on_stage_1_on_every_rank(tmp_path):
    toml = _split_toml(tmp_path / "split.toml", FIRST, ["vision_encoder", *LAST])
    with pytest.raises(pytest.fail.Exception):
        run_train(
            tmp_path,
            "rejected",
            2,
            str(toml),
            ["--training.steps=1", "--training.seq_len=256"],
            timeout_s=TIMEOUT_S,
            env={"LOG_RANK": "0,1"},
        )
    log = (tmp_path / "rejected.log").read_text()
    message = "puts 'vision_encoder' in part 1"
    for rank in (0, 1):
        assert any(
            line.startswith(f"[rank{rank}]:") and message in line
            for line in log.splitlines()
        ), log[-3000:]
