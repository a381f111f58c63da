"""Replicated and sharded CP vision in one launch, and the bytes the exchange moves.

``set_vision_mode`` switches a built Trainer: ``batch_generator`` and the
forward read the mode at run time, and the vision modules' build-time sharding
differs between modes only in the activations' cp type, alike on both sides
of every input and output, so with spmd_types and type checking off two
attributes are the whole switch (at CP1 both modes run the replicated path).
``ExchangeBytes`` counts the exchange's collectives through a counting
``spmd_types._dist``.
"""

import contextlib
from collections import defaultdict
from collections.abc import Sequence
from unittest import mock

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _live_memory import graph_nodes
from torch.utils._pytree import tree_leaves

VISION_MODES = ("replicated", "sharded")


def set_vision_mode(trainer, mode: str) -> None:
    """Switch ``trainer`` to CP vision ``mode`` (see the module's docstring)."""
    parallelism, debug = trainer.config.parallelism, trainer.config.debug
    if parallelism.spmd_backend != "spmd_types" or debug.spmd_typechecking:
        raise ValueError(
            "switching context_parallel_vision in a built Trainer needs the "
            "spmd_types backend without --debug.spmd_typechecking; got "
            f"{parallelism.spmd_backend!r}, typechecking {debug.spmd_typechecking}"
        )
    parallelism.context_parallel_vision = mode
    for model in trainer.model_parts:
        model.config.context_parallel_vision = mode


def modes_at(trainer, modes: Sequence[str]) -> list[str]:
    """The modes worth running: at CP1 they coincide (no share without CP)."""
    return list(modes) if trainer.parallel_dims.cp_enabled else ["replicated"]


def with_vision_share(trainer, batch: _harness.Batch, mode=None) -> _harness.Batch:
    """A copy of ``batch`` as ``batch_generator`` yields it (in sharded mode with
    this rank's share), in ``mode`` if given: the forward records a mode-dependent
    spmd type on it."""
    if mode is not None:
        set_vision_mode(trainer, mode)
    return next(trainer.batch_generator([_harness.clone_batch(batch)]))


_COLLECTIVES = {"all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all"}
_COLLECTIVES |= {"reduce_scatter", "reduce_scatter_tensor"}


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
    """Bytes the vision exchange's collectives move on this rank in a ``with``:
    per phase each collective's whole buffer (all-gather output, reduce-scatter
    input), and what a ring sends per rank (``(cp - 1) / cp`` of it)."""

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
        # The largest buffer among the tensor arguments (a list summed).
        nbytes = max(
            sum(t.nbytes for t in tree_leaves(a) if torch.is_tensor(t)) for a in args
        )
        group_size = torch.distributed.get_world_size(kwargs.get("group"))
        self.buffer_bytes[phase] += nbytes
        self.calls[f"{phase}/{op}"] += 1
        self.wire_bytes += nbytes * (group_size - 1) / group_size

    def _exchange(self, exchange):
        def counted(local_rows_RD, *args, **kwargs):
            with mock.patch.object(self, "_depth", self._depth + 1):
                bank_TD = exchange(local_rows_RD, *args, **kwargs)
            stop = {id(local_rows_RD.grad_fn)} if local_rows_RD.grad_fn else set()
            self._nodes.update(graph_nodes(bank_TD, stop))
            return bank_TD

        return counted

    def __enter__(self) -> "ExchangeBytes":
        import spmd_types._dist as spmd_dist

        from torchtitan_ext.muse_glimmer import model as model_module

        exchange = self._exchange(model_module.exchange_vision_rows)
        self._stack.enter_context(
            mock.patch.object(model_module, "exchange_vision_rows", exchange)
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
