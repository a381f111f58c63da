"""Switch torchtitan to the CPU backend before any test imports it; shared fixtures."""

from pathlib import Path

import pytest

from torchtitan_ext import cpu_backend

cpu_backend.apply()

from torchtitan_ext.embedded_data import (  # noqa: E402
    EmbeddedAssets,
    ensure_embedded_assets,
)


@pytest.fixture(scope="session", autouse=True)
def embedded_assets() -> EmbeddedAssets:
    """The generated data set and tokenizer the plug-in's jobs train on: made
    first, as the launcher makes them, for the tests that build jobs in process."""
    return ensure_embedded_assets()


@pytest.fixture(scope="session")
def no_image_assets() -> EmbeddedAssets:
    """The OBELICS-layout variant in which some samples have no image."""
    return ensure_embedded_assets(variant="some_without_image")


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory, embedded_assets) -> Path:
    """The debug model's initial weights, made once (1 rank, ``--debug.seed=42``).

    Every parity suite, resume run and probe of the debug model starts from
    it: the weights depend on the model and the seed only, not on the job's
    data, packing or parallelism (upstream and plug-in jobs alike).
    """
    from .training_runs import checkpoint_path, run_train

    dump = run_train(
        tmp_path_factory.mktemp("seed"),
        "seed",
        "packed.toml",
        [
            "--debug.deterministic",
            "--debug.seed=42",
            "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint",
        ],
        timeout_s=1200,
    )
    return checkpoint_path(dump, 0)


@pytest.fixture(scope="session")
def hf_seed_checkpoint(tmp_path_factory, seed_checkpoint) -> Path:
    """``seed_checkpoint``'s weights as a Hugging Face checkpoint, byte for byte.

    What users start from: ``model.safetensors`` and ``config.json`` through
    torchtitan's state-dict adapter, loaded with ``--checkpoint.initial_load_in_hf``.
    """
    from torchtitan_ext.tools.hf_checkpoint import write_hf_checkpoint

    from .training_runs import checkpoint_tensors

    return write_hf_checkpoint(
        tmp_path_factory.mktemp("hf_seed"), checkpoint_tensors(seed_checkpoint)
    )
