"""Where the generated debug data lives, and where the debug jobs look for it.

The jobs only name these folders; ``python -m torchtitan_ext.embedded_data``
makes them, and so does ``python -m torchtitan_ext.train`` (``run_train.sh``'s
entry) on first use, for a job that does not point both paths elsewhere.
"""

import os
from pathlib import Path

__all__ = ["ASSETS_ENV_VAR", "DATASET_FOLDER", "TOKENIZER_FOLDER", "default_root"]

ASSETS_ENV_VAR = "TORCHTITAN_EXT_ASSETS"
TOKENIZER_FOLDER = "tokenizer"
DATASET_FOLDER = "cc12m"  # the default variant's, in cc12m's tar layout


def default_root(variant: str = "default") -> Path:
    """``$TORCHTITAN_EXT_ASSETS`` or ``<repo>/assets/embedded``; other variants
    live in a sibling ``<root>-<variant>``."""
    env = os.environ.get(ASSETS_ENV_VAR)
    base = Path(env) if env else Path(__file__).resolve().parents[1] / "assets"
    root = base if env else base / "embedded"
    return root if variant == "default" else root.with_name(f"{root.name}-{variant}")
