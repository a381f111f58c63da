"""Invalid jobs fail at start-up, every rank alike, with a message naming the values.

Each case is a combination a user reaches through a TOML file or the command
line. Where torchtitan 0.3.0 already fails at start-up and names the values
(an explicit dp_shard that does not multiply out, a tokenizer without a special
token, a missing dataset, a generated pipeline split that does not fit), the
test pins upstream's message; elsewhere it pins the plug-in's
(``torchtitan_ext.muse_glimmer.config_checks``). One real 2-rank launch shows a
bad pipeline split exiting fast on both ranks, message in the log, instead of
failing inside the first step.
"""

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets.exceptions import DataFilesNotFoundError
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
)

from torchtitan_ext.embedded_data import ensure_embedded_assets
from torchtitan_ext.muse_glimmer import config_registry as registry
from torchtitan_ext.muse_glimmer import trainer
from torchtitan_ext.muse_glimmer.config_checks import check_job_config

from ..jobs import train_config

_IMAGE_TOKEN = "<|image_pad|>"


def _world_size(job) -> int:
    parallelism = job.parallelism
    return math.prod(
        (
            max(parallelism.data_parallel_shard_degree, 1),
            parallelism.data_parallel_replicate_degree,
            parallelism.context_parallel_degree,
            parallelism.tensor_parallel_degree,
            parallelism.pipeline_parallel_degree,
        )
    )


def _update(job) -> None:
    job.model_spec.model.update_from_config(config=job)


@pytest.mark.parametrize("name", registry.__all__)
def test_every_shipped_job_passes_the_checks(name):
    job = getattr(registry, name)()
    check_job_config(job, _world_size(job))


# World size against the product of the degrees.


@pytest.mark.parametrize(
    ("cp", "world_size", "product"), [(4, 2, 4), (2, 3, 2)], ids=["larger", "odd"]
)
def test_degrees_that_do_not_divide_the_world_are_rejected(cp, world_size, product):
    job = registry.muse_glimmer_debugmodel_mm_packed()
    job.parallelism.context_parallel_degree = cp
    with pytest.raises(ValueError) as error:
        check_job_config(job, world_size)
    assert str(error.value) == (
        "data_parallel_replicate_degree=1 * context_parallel_degree="
        f"{cp} * tensor_parallel_degree=1 * pipeline_parallel_degree=1 = {product} "
        f"must divide the world size {world_size} (data_parallel_shard_degree=-1 "
        f"takes the quotient); launch a multiple of {product} ranks or lower the "
        f"degrees so that their product divides {world_size}."
    )


def test_upstream_names_an_explicit_dp_shard_that_does_not_multiply_out():
    job = train_config("cp2.toml")
    job.parallelism.data_parallel_shard_degree = 2
    check_job_config(job, world_size=2)  # left to upstream: no second message
    with pytest.raises(AssertionError) as error:
        ParallelDims.from_config(job.parallelism, world_size=2)
    assert str(error.value) == (
        "Invalid parallel dims: dp_replicate(1) * dp_shard(2) * cp(2) * tp(1) * "
        "pp(1) != WORLD_SIZE(2)"
    )


# CP degree against the sequence.


def _cp_degree_error(degree: int):
    """The packed job at CP ``degree`` on as many ranks, and its start-up error."""
    job = registry.muse_glimmer_debugmodel_mm_packed()
    job.parallelism.context_parallel_degree = degree
    with pytest.raises(ValueError) as error:
        check_job_config(job, world_size=degree)
    return job, str(error.value)


def test_cp_degree_above_the_sequence_names_the_smallest_valid_length():
    _, error = _cp_degree_error(8)
    assert error == (
        "training.seq_len=512 must be divisible by lcm(2*tp*cp, 128*cp) = "
        "lcm(16, 1024) = 1024 with tensor_parallel_degree=1 and "
        "context_parallel_degree=8; nearest valid values: 1024."
    )


def test_cp_degree_no_sequence_allows_names_the_largest_degree():
    job, error = _cp_degree_error(64)
    message = (
        "context_parallel_degree=64 needs training.seq_len to be a multiple of "
        "lcm(2*tp*cp, 128*cp) = 8192 with tensor_parallel_degree=1, more than the "
        "model's max_seq_len=4096; the largest context_parallel_degree this model "
        "allows is 32."
    )
    assert error == message
    with pytest.raises(ValueError) as error:
        _update(job)
    assert str(error.value) == message


def test_cp_check_runs_before_the_trainers_shorter_divisor_check():
    # Upstream's Trainer would say "must be divisible by 4" for this job.
    job = train_config("cp2.toml")
    job.training.seq_len = 130
    with pytest.raises(ValueError) as error:
        check_job_config(job, world_size=2)
    assert str(error.value) == (
        "training.seq_len=130 must be divisible by lcm(2*tp*cp, 128*cp) = "
        "lcm(4, 256) = 256 with tensor_parallel_degree=1 and "
        "context_parallel_degree=2; nearest valid values: 256."
    )


# Heads under TP.


@pytest.mark.parametrize(
    ("tp", "vision_heads", "named", "valid"),
    [
        (2, 3, "n_heads (4), n_kv_heads (2), vision_encoder.num_heads (3)", [1]),
        (3, 4, "n_heads (4), n_kv_heads (2), vision_encoder.num_heads (4)", [1, 2]),
    ],
    ids=["vision-only", "debug-flavor-tp3"],
)
def test_heads_not_divisible_by_tp_fail_at_config_time(tp, vision_heads, named, valid):
    # Upstream names one decoder count at a time, the vision heads only at
    # parallelize time; the debug flavor's 4 + 4 heads meet TP 3 together.
    job = train_config("tp2_sp.toml")
    job.parallelism.tensor_parallel_degree = tp
    job.training.seq_len = 384
    job.model_spec.model.vision_encoder.num_heads = vision_heads
    message = (
        f"tensor_parallel_degree ({tp}) must divide every attention head count: "
        f"{named}; valid degrees: {valid}."
    )
    with pytest.raises(ValueError) as error:
        check_job_config(job, world_size=tp)
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        _update(job)
    assert str(error.value) == message


# Tokenizer and dataset.


def _tokenizer_without(token: str, out: Path) -> Path:
    source = ensure_embedded_assets().tokenizer_dir
    shutil.copytree(source, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [
        added for added in tokenizer["added_tokens"] if added["content"] != token
    ]
    del tokenizer["model"]["vocab"][token]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        key: added
        for key, added in config["added_tokens_decoder"].items()
        if added["content"] != token
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_upstream_names_a_missing_tokenizer_special_token(tmp_path):
    job = registry.muse_glimmer_debugmodel_mm()
    path = _tokenizer_without(_IMAGE_TOKEN, tmp_path / "tokenizer")
    with pytest.raises(ValueError) as error:
        job.tokenizer.build(tokenizer_path=str(path))
    assert str(error.value) == (
        f"Special token '{_IMAGE_TOKEN}' (config field 'image_token') not found in "
        f"tokenizer at '{path}'. Available added tokens: ['<|endoftext|>', "
        "'<|begin_of_text|>', '<|end_of_text|>', '<unk>', '<|video_pad|>', "
        "'<|vision_start|>', '<|vision_end|>']"
    )


def _build_dataloader(job, dataset_path: str):
    job.dataloader.dataset_path = dataset_path
    return job.dataloader.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=job.tokenizer.build(tokenizer_path=job.hf_assets_path),
        seq_len=job.training.seq_len,
        local_batch_size=job.training.local_batch_size,
    )


def test_upstream_names_a_missing_dataset_path(tmp_path):
    job = registry.muse_glimmer_debugmodel_mm()
    missing = tmp_path / "nonexistent"
    with pytest.raises(FileNotFoundError) as error:
        _build_dataloader(job, str(missing))
    assert str(error.value) == f"Couldn't find any data file at {missing}."


def test_upstream_names_a_dataset_path_without_data_files(tmp_path):
    job = registry.muse_glimmer_debugmodel_mm()
    with pytest.raises(DataFilesNotFoundError) as error:
        _build_dataloader(job, str(tmp_path))
    assert str(error.value) == f"No (supported) data files found in {tmp_path}"


# Pipeline splits.


def _pp2(schedule: str = "1F1B", **parallelism):
    job = train_config("pp2.toml")
    job.parallelism.pipeline_parallel_schedule = schedule
    for name, value in parallelism.items():
        setattr(job.parallelism, name, value)
    return job


def _layers(*indices: int) -> list[str]:
    return [f"layers.{i}" for i in indices]


def test_upstream_names_a_generated_split_with_too_many_stages():
    job = _pp2(pipeline_parallel_layers_per_stage=1)
    with pytest.raises(ValueError) as error:
        _get_pipeline_metadata(
            SimpleNamespace(pp=2), job.parallelism, job.model_spec.model
        )
    assert str(error.value) == (
        "Single stage schedule requires exactly 1 stage per rank, but got 5 stages "
        "per rank. Model has 8 layers with pipeline_parallel_layers_per_stage=1, "
        "resulting in num_virtual_stages=10 across 2 PP ranks. Please increase "
        "pipeline_parallel_layers_per_stage to 4 or higher to achieve 1 stage per "
        "rank."
    )
    # Interleaved on 6 ranks: 2 stages each, more than 8 layers + 2 weights.
    stages, layers, first, last = _get_pipeline_metadata(
        SimpleNamespace(pp=6), _pp2("Interleaved1F1B").parallelism, job.model_spec.model
    )
    with pytest.raises(ValueError) as error:
        _generate_llm_fqn_per_model_part(stages, layers, first, last)
    assert str(error.value) == (
        "Number of stages (12) cannot be greater than effective layers (10)"
    )


FOUR_PARTS = [
    ["tok_embeddings", *_layers(0, 1)],
    _layers(2, 3),
    _layers(4, 5),
    [*_layers(6, 7), "norm", "lm_head"],
]


@pytest.mark.parametrize(
    ("schedule", "parts", "message"),
    [
        (
            "1F1B",
            FOUR_PARTS,
            "parallelism.module_fqns_per_model_part has 4 parts; "
            "pipeline_parallel_schedule='1F1B' runs one stage per rank, so with "
            "pipeline_parallel_degree=2 it needs exactly 2 parts (or choose a "
            "multi-stage schedule such as 'Interleaved1F1B').",
        ),
        (
            "1F1B",
            [
                ["tok_embeddings", *_layers(0, 1, 2)],
                [*_layers(4, 5, 6, 7), "norm", "lm_head"],
            ],
            "parallelism.module_fqns_per_model_part must name layers.0 .. layers.7 "
            "once each, in order across its parts (the model has 8 decoder layers); "
            "got layers [0, 1, 2, 4, 5, 6, 7].",
        ),
        (
            "Interleaved1F1B",
            [FOUR_PARTS[0], FOUR_PARTS[2], FOUR_PARTS[1], FOUR_PARTS[3]],
            "parallelism.module_fqns_per_model_part must name layers.0 .. layers.7 "
            "once each, in order across its parts (the model has 8 decoder layers); "
            "got layers [0, 1, 4, 5, 2, 3, 6, 7].",
        ),
        (
            "1F1B",
            [
                ["tok_embeddings", *_layers(0, 1, 2, 3), "norm"],
                [*_layers(4, 5, 6, 7), "lm_head"],
            ],
            "parallelism.module_fqns_per_model_part must put 'norm' in its last "
            "part (part 1) only; got it in parts [0].",
        ),
    ],
    ids=["more-parts-than-stages", "missing-layer", "out-of-order", "norm-early"],
)
def test_user_split_that_does_not_fit_is_rejected(schedule, parts, message):
    job = _pp2(schedule, module_fqns_per_model_part=parts)
    with pytest.raises(ValueError) as error:
        check_job_config(job, world_size=2)
    assert str(error.value) == message


def test_user_split_that_fits_passes():
    check_job_config(_pp2("Interleaved1F1B", module_fqns_per_model_part=FOUR_PARTS), 2)


# Real launches: a bad job exits non-zero, fast, with the message in the log.


def test_trainer_checks_the_job_before_parallel_dims(monkeypatch):
    # Upstream's ParallelDims would fail on a bare ``assert dp_shard >= 1``.
    monkeypatch.setenv("WORLD_SIZE", "2")
    job = train_config("cp4.toml")
    with pytest.raises(ValueError) as error:
        trainer.MuseGlimmerTrainer.init_distributed(SimpleNamespace(config=job))
    assert str(error.value).startswith(
        "data_parallel_replicate_degree=1 * context_parallel_degree=4 * "
        "tensor_parallel_degree=1 * pipeline_parallel_degree=1 = 4 must divide "
        "the world size 2"
    )


# Image normalisation and pixel budget (torchtitan 0.3.0 takes any value).


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("image_std", (0.0, 0.5, 0.5), "image_std = (0.0, 0.5, 0.5): every value"),
        ("image_std", (1e-45, 0.5, 0.5), "image_std = (1e-45, 0.5, 0.5): every"),
        (
            "image_std",
            (math.nan, 0.5, 0.5),
            "image_std = (nan, 0.5, 0.5): need 3 finite",
        ),
        (
            "image_mean",
            (0.5, math.inf, 0.5),
            "image_mean = (0.5, inf, 0.5): need 3 finite",
        ),
        ("image_mean", (0.5, 0.5), "image_mean = (0.5, 0.5): need 3 finite values"),
        ("min_pixels", 5000, "min_pixels = 5000 and max_pixels = 3136: need 784 <="),
        ("min_pixels", 100, "min_pixels = 100 and max_pixels = 3136: need 784 <="),
        ("max_images_per_batch", 0, "max_images_per_batch = 0: need at least 1"),
    ],
)
def test_bad_image_settings_are_named_at_start_up(field, value, named):
    job = train_config("cp2.toml")
    setattr(job.dataloader, field, value)
    with pytest.raises(ValueError, match=re.escape(f"dataloader.{named}")):
        check_job_config(job, _world_size(job))


def test_the_validators_image_settings_are_checked_too():
    job = train_config("cp2.toml")
    job.validator.enable = True
    job.validator.dataloader = dataclasses.replace(
        job.dataloader, image_std=(0.5, 0.0, 0.5)
    )
    with pytest.raises(ValueError, match=r"validator\.dataloader\.image_std"):
        check_job_config(job, _world_size(job))
