"""torchtitan 0.3.0's ``_inject_vision`` alone, the reference the gather must equal
(``tests/unit/test_vision_bank.py``: bitwise; ``benchmarks/vision_injection.py``):
just what it reads of its model, projection and norm as identities."""

from torch import nn
from torchtitan.models.muse_glimmer.model import MuseGlimmerModel as UpstreamModel

__all__ = ["UpstreamInjection"]


class UpstreamInjection(nn.Module):
    _vision_spans = UpstreamModel._vision_spans
    _inject_vision = UpstreamModel._inject_vision

    def __init__(self) -> None:
        super().__init__()
        self.vision_projection = nn.Identity()
        self.perception_emb_norm = nn.Identity()
