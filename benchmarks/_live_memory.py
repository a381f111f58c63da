"""Live tensor memory by training phase and model region, from the dispatcher.

``LiveMemory`` files every storage an aten op creates (until it dies) under the
current phase (the caller's, or ``backward`` in the autograd engine) and
region (``vision`` inside ``vision_modules`` and their autograd nodes, else
``decoder``); ``attn_scratch`` is what an attention HOP's eager kernel frees
before it returns (CPU scores a fused GPU kernel never stores). Storages
resized outside the dispatcher (FSDP2's unsharded parameters) count from their
``resize_``, as ``resized``. Not torch's ``MemTracker``: that cannot see into
a HOP's kernel and files FSDP's all-gather buffers as parameters (the README's
3.4 MB planner gap).
"""

import weakref
from collections import defaultdict
from collections.abc import Iterable
from unittest import mock

import torch
from torch import nn
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten

__all__ = ["LiveMemory", "graph_nodes", "storage_bytes"]


def _plain_tensors(value) -> Iterable[torch.Tensor]:
    for leaf in tree_flatten(value)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            inner_names, _ = leaf.__tensor_flatten__()
            yield from _plain_tensors([getattr(leaf, name) for name in inner_names])
        else:
            yield leaf


def _storages(value) -> dict[int, torch.UntypedStorage]:
    tensors = (t for t in _plain_tensors(value) if t.device.type != "meta")
    return {s._cdata: s for s in (t.untyped_storage() for t in tensors)}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their shards)."""
    return sum(storage.nbytes() for storage in _storages(tensors).values())


def graph_nodes(outputs, stop: set) -> dict[int, object]:
    """Autograd nodes by id from ``outputs`` back to (excluding) the ids in ``stop``."""
    roots = [t.grad_fn for t in _plain_tensors(outputs) if t.grad_fn is not None]
    seen: dict[int, object] = {}
    while roots:
        node = roots.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        roots.extend(next_node for next_node, _ in node.next_functions)
    return seen


class LiveMemory(TorchDispatchMode):
    """Live (``current``) and peak bytes per ``phase/region`` category,
    ``peak_total`` of their sum and ``peak_fused`` of it without attention
    scratch; storages made before the mode do not count."""

    supports_higher_order_operators = True

    def __init__(self, vision_modules: Iterable[nn.Module] = ()) -> None:
        super().__init__()
        self.phase = "other"
        self.current: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak_total = 0
        self.fused = 0  # total less attention scratch
        self.peak_fused = 0
        self._live: dict[int, tuple[int, str, weakref.ref]] = {}
        self._vision_depth = 0
        self._vision_nodes: dict[int, object] = {}
        self._kernel: tuple[str, list[int]] | None = None
        self._hooks = []
        for module in vision_modules:
            # After FSDP's own pre-forward hook: its all-gather is not vision.
            self._hooks.append(module.register_forward_pre_hook(self._enter_vision))
            self._hooks.append(module.register_forward_hook(self._exit_vision))

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._vision_nodes.clear()

    def _enter_vision(self, module, args) -> None:
        self._vision_depth += 1
        module._live_memory_input_nodes = {
            id(t.grad_fn) for t in _plain_tensors(args) if t.grad_fn is not None
        }

    def _exit_vision(self, module, args, output) -> None:
        self._vision_depth -= 1
        stop = module.__dict__.pop("_live_memory_input_nodes", set())
        self._vision_nodes.update(graph_nodes(output, stop))

    def _category(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            vision = node is not None and id(node) in self._vision_nodes
            return f"backward/{'vision' if vision else 'decoder'}"
        return f"{self.phase}/{'vision' if self._vision_depth > 0 else 'decoder'}"

    def __enter__(self):
        resize = torch.UntypedStorage.resize_

        def tracked_resize(storage, size):
            key, before = storage._cdata, storage.nbytes()
            out = resize(storage, size)
            if key in self._live:
                nbytes, category, ref = self._live[key]
                self._live[key] = (storage.nbytes(), category, ref)
                self._add(category, storage.nbytes() - before)
            else:  # not an activation: filed apart from the regions
                self._track({key: storage}, "resized")
            return out

        storage = torch.UntypedStorage
        self._resize = mock.patch.object(storage, "resize_", tracked_resize)
        self._resize.start()
        return super().__enter__()

    def __exit__(self, *args):
        self._resize.stop()
        return super().__exit__(*args)

    def _add(self, category: str, nbytes: int) -> None:
        self.current[category] += nbytes
        self.total += nbytes
        if not category.endswith("/attn_scratch"):
            self.fused += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, self.total)
        self.peak_fused = max(self.peak_fused, self.fused)

    def _free(self, key: int) -> None:
        if key in self._live:
            nbytes, category, _ = self._live.pop(key)
            self._add(category, -nbytes)

    def _track(self, storages: dict[int, torch.UntypedStorage], category: str):
        for key, storage in storages.items():
            if key in self._live:
                if self._live[key][2]() is not None:
                    continue
                self._free(key)  # its address was reused before the callback ran
            if self._kernel is not None:
                category = f"{self._kernel[0]}/attn_scratch"
                self._kernel[1].append(key)
            ref = weakref.ref(storage, lambda _, key=key: self._free(key))
            self._live[key] = (storage.nbytes(), category, ref)
            self._add(category, storage.nbytes())

    def _run_kernel(self, func, args, kwargs):
        """Run an attention HOP's eager kernel: what it allocates is scratch
        until it returns; then its outputs belong to the caller's region."""
        kernel = func.py_kernels[DispatchKey.CompositeExplicitAutograd]
        if self._kernel is not None:
            return kernel(*args, **kwargs)
        category, allocated = self._category(), []
        with mock.patch.object(self, "_kernel", (category, allocated)), self:
            out = kernel(*args, **kwargs)
        for key in _storages(out):
            if key in self._live and key in allocated:  # re-filed to its region
                nbytes, old, ref = self._live[key]
                self._add(old, -nbytes)
                self._add(category, nbytes)
                self._live[key] = (nbytes, category, ref)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            if DispatchKey.CompositeExplicitAutograd not in func.py_kernels:
                return NotImplemented
            return self._run_kernel(func, args, kwargs)
        out = func(*args, **kwargs)
        inputs = _storages((args, kwargs))
        created = {k: s for k, s in _storages(out).items() if k not in inputs}
        self._track(created, self._category())
        return out
