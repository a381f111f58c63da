"""Switch torchtitan to the CPU backend before any test imports it; shared fixtures."""

import pytest

from torchtitan_ext import cpu_backend

cpu_backend.apply()

from torchtitan_ext.tools.embedded_data import (  # noqa: E402
    EmbeddedAssets,
    ensure_embedded_assets,
)


@pytest.fixture(scope="session")
def embedded_assets() -> EmbeddedAssets:
    """The generated data set and tokenizer the plug-in's jobs train on."""
    return ensure_embedded_assets()


@pytest.fixture(scope="session")
def no_image_assets() -> EmbeddedAssets:
    """The OBELICS-layout variant in which some samples have no image."""
    return ensure_embedded_assets(variant="some_without_image")
