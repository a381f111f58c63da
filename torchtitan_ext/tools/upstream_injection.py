"""torchtitan 0.3.0's vision injection on its own: the reference the gather must equal.

Shared by ``tests/unit/test_vision_bank.py`` (values and gradients bitwise) and
``benchmarks/vision_injection.py`` (speed).
"""

from torch import nn
from torchtitan.models.muse_glimmer.model import MuseGlimmerModel as UpstreamModel

__all__ = ["UpstreamInjection"]


class UpstreamInjection(nn.Module):
    """torchtitan's ``_inject_vision`` on just what it reads of its model.

    Projection and norm are identities, so only the injection runs.
    """

    _vision_spans = UpstreamModel._vision_spans
    _inject_vision = UpstreamModel._inject_vision

    def __init__(self) -> None:
        super().__init__()
        self.vision_projection = nn.Identity()
        self.perception_emb_norm = nn.Identity()
