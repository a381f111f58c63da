"""Per-step scalars of a run, read back from its TensorBoard events."""

import os
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

__all__ = ["GRAD_NORM_TAG", "LOSS_TAG", "ParityError", "RunScalars", "read_tb_scalars"]

# The tags torchtitan's ``MetricsProcessor.log`` writes.
LOSS_TAG = "loss_metrics/global_avg_loss"
GRAD_NORM_TAG = "grad_norm"


class ParityError(RuntimeError):
    """A run's outputs cannot be compared (no TensorBoard run, missing tags)."""


@dataclass(kw_only=True, slots=True)
class RunScalars:
    """Per-step scalars of one run, as stored in its TensorBoard events."""

    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)


def read_tb_scalars(tb_folder: str | os.PathLike[str]) -> RunScalars:
    """Read loss and grad_norm per step from ``<dump_folder>/<save_tb_folder>``.

    torchtitan writes each run into a ``<YYYYmmdd-HHMM>`` subfolder; exactly one
    must exist, or the values could silently come from a stale run.
    """
    root = Path(tb_folder)
    if not root.is_dir():
        raise ParityError(f"TensorBoard folder does not exist: {root}")
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    if len(runs) != 1:
        found = ", ".join(p.name for p in runs) or "none"
        raise ParityError(
            f"expected exactly one TensorBoard run directory in {root}, "
            f"found {len(runs)}: {found}"
        )
    # size_guidance 0 keeps every event: the default samples scalars.
    acc = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    values: dict[str, dict[int, float]] = {}
    for tag in (LOSS_TAG, GRAD_NORM_TAG):
        if tag not in tags:
            raise ParityError(
                f"scalar tag {tag!r} not found in {runs[0]}; available: {tags}"
            )
        # A step logged twice keeps its last value, as TensorBoard shows it.
        values[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return RunScalars(loss=values[LOSS_TAG], grad_norm=values[GRAD_NORM_TAG])
