"""Per-parameter comparison of AdamW's first moments in two runs' checkpoints.

The loss and the gradient norm are two scalars: a bug that moves a few
parameters' gradients (one image's rows, one module's reduction) can hide in
them. The first moment after step ``n`` is a decayed sum of the first ``n``
gradients, and DCP stores it per parameter at any world size.
"""

import functools
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

__all__ = ["MomentComparison", "checkpoint_tensors", "compare_first_moments"]

_FIRST_MOMENT = ".exp_avg"


def _flatten(value, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, torch.Tensor):
        out[prefix] = value


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint (any world size) as ``{dotted.key: tensor}``; not cached,
    as a caller may compare checkpoints it rewrites."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    tensors: dict[str, torch.Tensor] = {}
    _flatten(state, "", tensors)
    return tensors


@dataclass(kw_only=True, slots=True)
class MomentComparison:
    """Per first moment: max |test - baseline| / max |baseline| of the tensor."""

    errors: dict[str, float]
    tol: float
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def max_error(self) -> float | None:
        return max(self.errors.values(), default=None)

    def summary(self, worst: int = 5) -> dict:
        errors = self.errors.values()
        ranked = sorted(self.errors.items(), key=lambda item: -item[1])
        return {
            "tol": self.tol,
            "tensors": len(self.errors),
            "max_error": self.max_error,
            "median_error": statistics.median(errors) if errors else None,
            "worst": dict(ranked[:worst]),
            "passed": self.passed,
            "failures": self.failures,
        }


@functools.lru_cache(maxsize=8)
def _first_moments(path: Path) -> dict[str, torch.Tensor]:
    """Cached: a suite's baseline is read once for all its tests."""
    return {
        k: v for k, v in checkpoint_tensors(path).items() if k.endswith(_FIRST_MOMENT)
    }


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    error = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    if error == 0.0:
        return 0.0
    return error / scale if scale > 0 else float("inf")


def compare_first_moments(
    baseline_checkpoint: Path, test_checkpoint: Path, *, tol: float
) -> MomentComparison:
    """Every parameter's first moment in ``test`` within ``tol`` of ``baseline``'s.

    Relative to the baseline tensor's largest entry, so the bound means the
    same for large and small parameters; a non-finite moment, a moment present
    on one side only, or no moment at all fails.
    """
    ref = _first_moments(baseline_checkpoint)
    got = _first_moments(test_checkpoint)
    failures: list[str] = []
    if not ref:
        failures.append(f"no first moments ({_FIRST_MOMENT}) in {baseline_checkpoint}")
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    if missing or extra:
        failures.append(
            f"first moments differ in keys: only in baseline {missing[:5]}, "
            f"only in test {extra[:5]}"
        )
    errors = {k: _relative_error(got[k], ref[k]) for k in sorted(ref) if k in got}
    over = sorted(((e, k) for k, e in errors.items() if not e <= tol), reverse=True)
    for error, key in over[:5]:
        failures.append(f"first moment {key}: relative error {error:.3e} > {tol:.3e}")
    if len(over) > 5:
        failures.append(f"... and {len(over) - 5} more first moments over {tol:.3e}")
    return MomentComparison(errors=errors, tol=tol, failures=failures)
