"""Host-side integer values under ``FakeTensorMode``, so data-dependent code runs.

FakeTensorMode raises on every op whose result depends on values; torchtitan's
vision encoder reads its geometry on the host (``grid_thw.tolist()``, a boolean
index ``idx[idx != -1]``). ``HostValues`` keeps the real values of integer and
boolean tensors: those passed in real, and the outputs of ops whose inputs all
have known values (or of an integer factory such as ``arange``), run again on
the real values. Floating-point tensors are never computed for real; an op
that writes unknown data into a known tensor makes it unknown.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HostValues"]

_INTEGER_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
)


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


class HostValues(TorchDispatchMode):
    """Real values of the integer tensors of a fake-mode run. Enter it right
    after ``fake_mode``; modes entered later (a tracker) see its fake outputs."""

    supports_higher_order_operators = True

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self._fake_mode = fake_mode
        self._values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The real value of an integer ``tensor``, or None if it is not known."""
        if tensor.dtype not in _INTEGER_DTYPES:
            return None
        if not isinstance(tensor, FakeTensor):
            return tensor
        return self._values.get(tensor)

    def fake(self, tree):
        """``tree`` with its tensors made fake, integer ones keeping their values
        (block masks are no pytree nodes: they stay real)."""

        def fake(tensor: torch.Tensor) -> torch.Tensor:
            fake_tensor = self._fake_mode.from_tensor(tensor)
            if tensor.dtype in _INTEGER_DTYPES:
                self._values[fake_tensor] = tensor
            return fake_tensor

        return tree_map_only(torch.Tensor, fake, tree)

    def _forget_written(self, func, args, kwargs) -> None:
        schema = getattr(func, "_schema", None)
        if schema is None:
            return
        bound = dict(zip((a.name for a in schema.arguments), args, strict=False))
        bound.update(kwargs)
        for argument in schema.arguments:
            written = argument.alias_info is not None and argument.alias_info.is_write
            for tensor in _tensors(bound.get(argument.name)) if written else ():
                self._values.pop(tensor, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars to local ops first
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        values = [self.value(t) for t in inputs]
        if any(v is None for v in values):
            self._forget_written(func, args, kwargs)
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = None
        if out is not None and not inputs:
            created = _tensors(out)
            if not created or any(t.dtype not in _INTEGER_DTYPES for t in created):
                return out  # a floating-point factory: fake only
        real = dict(zip(map(id, inputs), values, strict=True))
        flat, spec = tree_flatten((args, kwargs))
        real_args, real_kwargs = tree_unflatten(
            [real[id(x)] if isinstance(x, torch.Tensor) else x for x in flat], spec
        )
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        if out is None:
            # The fake op cannot size its output (or returns a host value).
            out = tree_map_only(torch.Tensor, self._fake_mode.from_tensor, real_out)
        for fake, value in zip(_tensors(out), _tensors(real_out), strict=True):
            if isinstance(fake, FakeTensor):
                self._values[fake] = value
        return out
