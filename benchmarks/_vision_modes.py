"""Replicated and sharded CP vision in one launch, and the bytes the exchange moves.

``set_vision_mode`` switches a built Trainer between the modes. The mode is
read at run time in two places: the Trainer's ``batch_generator`` (through
``_share_of``: whether a batch gets this CP rank's share of its images) and
the model's forward (``config.context_parallel_vision``: the spmd type its
vision inputs are asserted to have, and the local-axes region it does so in).
What the job fixes at build time, the vision modules' sharding configs
(``set_cp_vision_sharding_config``), differs between the modes only in the cp
type of activations, ``R`` or ``V``, and that type is the same on the source
and the destination side of every input and output (``_on_cp_everywhere``;
the rope cache is ``R`` and vision attention's q/k/v are the activation type on
both sides). So torchtitan's ``Module._redistribute_inputs`` and
``_redistribute_outputs`` issue no cp collective in either mode
(``spmd_redistribute_per_axis`` skips an axis whose type does not change);
the declared types are checked only under ``--debug.spmd_typechecking``, the
local maps' in-grad placements are read only by the DTensor backends, and the
parameters are ``R`` on cp in both. Hence with the spmd_types backend and type
checking off (as in the benchmark jobs) setting the two attributes is the
whole switch; ``set_vision_mode`` refuses any other job. At CP1 both modes run
the replicated path (no share without CP).

``ExchangeBytes`` counts what the exchange's collectives move: spmd_types calls
torch.distributed through a patchable reference (``spmd_types._dist``), so a
counting stand-in sees every collective it issues, and keeps those of
``exchange_vision_rows``: its forward all-gather runs inside the call, its
backward reduce-scatter in an autograd node the call created.
"""

import contextlib
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _harness import alternating, median_pair_ratio
from _live_memory import graph_nodes

__all__ = [
    "VISION_MODES",
    "ExchangeBytes",
    "compare_slowest_ranks",
    "modes_at",
    "ratio_cells",
    "set_vision_mode",
    "time_in_pairs",
    "train_step_in",
    "with_vision_share",
]

VISION_MODES = ("replicated", "sharded")


def set_vision_mode(trainer, mode: str) -> None:
    """Switch ``trainer`` to CP vision ``mode`` (see the module's docstring)."""
    config = trainer.config
    if config.parallelism.spmd_backend != "spmd_types" or (
        config.debug.spmd_typechecking
    ):
        raise ValueError(
            "switching context_parallel_vision in a built Trainer needs the "
            "spmd_types backend without --debug.spmd_typechecking; got "
            f"{config.parallelism.spmd_backend!r}, typechecking "
            f"{config.debug.spmd_typechecking}"
        )
    config.parallelism.context_parallel_vision = mode
    for model in trainer.model_parts:
        model.config.context_parallel_vision = mode


def modes_at(trainer, modes: Sequence[str]) -> list[str]:
    """The modes worth running: at CP1 they coincide (no share without CP)."""
    return list(modes) if trainer.parallel_dims.cp_enabled else ["replicated"]


def train_step_in(trainer, mode: str, batch: _harness.Batch) -> float:
    """One ``Trainer.train_step`` in ``mode`` on a fresh copy of ``batch`` (ms)."""
    set_vision_mode(trainer, mode)
    return _harness.train_step(trainer, with_vision_share(trainer, batch))


def time_in_pairs(
    trainer, modes: Sequence[str], pairs: int, timed: Callable[[str], dict]
) -> dict[str, list[dict[str, float]]]:
    """``timed(mode)`` in each mode, alternating in ``pairs``; each mode's results."""
    times = {mode: [] for mode in modes}
    for order in alternating(modes, pairs):
        for mode in order:
            set_vision_mode(trainer, mode)
            times[mode].append(timed(mode))
    return times


def compare_slowest_ranks(
    rank_times: Sequence[dict[str, list[dict[str, float]]]], phases: Sequence[str]
) -> dict:
    """Per mode and phase the median of the slowest rank's time, pair by pair.

    ``rank_times`` holds each rank's ``time_in_pairs`` result. With both modes,
    ``sharded_ratio``: sharded over replicated per pair, of the slowest ranks'
    ``phases[-1]`` times, median and [first, third] quartiles.
    """
    summary = {}
    slowest = {}
    for mode in rank_times[0]:
        for phase in phases:
            slowest[mode, phase] = [
                max(pair[phase] for pair in rank_pairs)
                for rank_pairs in zip(*(t[mode] for t in rank_times), strict=True)
            ]
            summary[f"{mode}_{phase}"] = statistics.median(slowest[mode, phase])
    if len(rank_times[0]) > 1:
        total = phases[-1]
        summary["sharded_ratio"], summary["sharded_ratio_quartiles"] = (
            median_pair_ratio(slowest["sharded", total], slowest["replicated", total])
        )
    return summary


def ratio_cells(summary: dict) -> list[str]:
    """``compare_slowest_ranks``' ratio and its quartiles, as table cells."""
    if "sharded_ratio" not in summary:
        return ["-", "-"]
    low, high = summary["sharded_ratio_quartiles"]
    return [f"{summary['sharded_ratio']:.2f}x", f"{low:.2f}-{high:.2f}x"]


def with_vision_share(trainer, batch: _harness.Batch) -> _harness.Batch:
    """A fresh copy of ``batch`` as the Trainer's ``batch_generator`` yields it.

    Checked, and in sharded mode carrying this CP rank's share of the images.
    A copy, since the model's forward records an spmd type on the vision
    inputs that differs between the modes.
    """
    return next(trainer.batch_generator([_harness.clone_batch(batch)]))


_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_reduce",
        "all_to_all",
        "reduce_scatter",
        "reduce_scatter_tensor",
    }
)


def _buffer_bytes(args) -> int:
    """The largest buffer among a collective's tensor arguments (a list summed)."""
    sizes = [0]
    for arg in args:
        if isinstance(arg, torch.Tensor):
            sizes.append(arg.nbytes)
        elif isinstance(arg, list | tuple):
            sizes.append(sum(t.nbytes for t in arg if isinstance(t, torch.Tensor)))
    return max(sizes)


class _CountingDist:
    """torch.distributed, with the collectives passed through ``record``."""

    def __init__(self, record) -> None:
        self._record = record

    def __getattr__(self, name: str):
        attr = getattr(torch.distributed, name)
        if name not in _COLLECTIVES:
            return attr

        def counted(*args, **kwargs):
            self._record(name, args, kwargs)
            return attr(*args, **kwargs)

        return counted


class ExchangeBytes(contextlib.AbstractContextManager):
    """Bytes the vision exchange's collectives move on this rank, in a ``with``.

    ``buffer_bytes["forward"|"backward"]`` sums, per collective, its whole
    buffer: the all-gather's output, the reduce-scatter's input (cp padded
    blocks each). ``wire_bytes`` is what a ring collective sends from (and
    receives into) each rank: ``(cp - 1) / cp`` of the buffer.
    """

    def __init__(self) -> None:
        self.buffer_bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.wire_bytes = 0.0
        self._depth = 0
        self._nodes: dict[int, object] = {}
        self._stack = contextlib.ExitStack()

    def _record(self, op: str, args, kwargs) -> None:
        node = torch._C._current_autograd_node()
        if self._depth > 0:
            phase = "forward"
        elif node is not None and id(node) in self._nodes:
            phase = "backward"
        else:
            return
        nbytes = _buffer_bytes(args)
        group_size = torch.distributed.get_world_size(kwargs.get("group"))
        self.buffer_bytes[phase] += nbytes
        self.calls[f"{phase}/{op}"] += 1
        self.wire_bytes += nbytes * (group_size - 1) / group_size

    def _exchange(self, exchange):
        def counted(local_rows_RD, *args, **kwargs):
            self._depth += 1
            try:
                bank_TD = exchange(local_rows_RD, *args, **kwargs)
            finally:
                self._depth -= 1
            stop = {id(local_rows_RD.grad_fn)} if local_rows_RD.grad_fn else set()
            for node in graph_nodes(bank_TD, stop):
                self._nodes[id(node)] = node
            return bank_TD

        return counted

    def __enter__(self) -> "ExchangeBytes":
        import spmd_types._dist as spmd_dist

        from torchtitan_ext.muse_glimmer import model as model_module

        self._stack.enter_context(
            _patched(model_module, "exchange_vision_rows", self._exchange)
        )
        spmd_dist.set_dist(_CountingDist(self._record))
        self._stack.callback(spmd_dist.set_dist, None)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._nodes.clear()

    def summary(self) -> dict:
        return {
            "exchange_forward_bytes": self.buffer_bytes["forward"],
            "exchange_backward_bytes": self.buffer_bytes["backward"],
            "exchange_wire_bytes": self.wire_bytes,
            "exchange_calls": dict(self.calls),
        }


@contextlib.contextmanager
def _patched(module, name: str, wrap):
    """``module.name`` replaced by ``wrap(module.name)`` for the ``with``."""
    original = getattr(module, name)
    setattr(module, name, wrap(original))
    try:
        yield
    finally:
        setattr(module, name, original)
