"""Live tensor memory by training phase and model region, from the dispatcher.

Peak RSS says nothing about *which* tensors were alive, so ``LiveMemory`` is a
``TorchDispatchMode`` that sees every storage an aten op creates (bytes
allocated minus freed, freed when the storage dies) and files it under the
phase and region current at allocation:

- phase: set by the caller (``inputs``, ``forward``, ``optimizer``, ...), and
  ``backward`` whenever the autograd engine runs;
- region: ``vision`` inside the modules passed as ``vision_modules``, in
  forward (module hooks) and in backward (the autograd nodes those modules
  created), else ``decoder``;
- ``attn_scratch``: buffers an attention kernel (a higher-order operator such
  as flex attention) allocates and frees before it returns. Its outputs (out,
  logsumexp; dq, dk, dv) count as ordinary tensors of their region. The eager
  dense kernel the CPU backend runs materializes [B, H, Lq, Lk] scores that a
  fused GPU kernel keeps in registers, so they get a column of their own.

Storages resized in place outside the dispatcher (FSDP2's unsharded
parameters) are not seen: they are parameters, not activations.
"""

import weakref
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten

__all__ = ["LiveMemory", "graph_nodes"]


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
    storages = {}
    for tensor in _plain_tensors(value):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage
    return storages


def graph_nodes(outputs, stop: set) -> list:
    """Autograd nodes from ``outputs`` back to (excluding) the nodes in ``stop``."""
    roots = [t.grad_fn for t in _plain_tensors(outputs) if t.grad_fn is not None]
    seen: dict[int, object] = {}
    while roots:
        node = roots.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        roots.extend(next_node for next_node, _ in node.next_functions)
    return list(seen.values())


class LiveMemory(TorchDispatchMode):
    """Bytes of live tensor storage per ``phase/region`` category, with peaks.

    ``current[c]`` and ``peak[c]`` are the live and peak bytes of category
    ``c``; ``peak_total`` is the peak of their sum and ``at_peak`` the
    categories at that moment. Only storages created while the mode is active
    count: parameters and optimizer state made before it are the caller's.
    """

    supports_higher_order_operators = True

    def __init__(self, vision_modules: Iterable[nn.Module] = ()) -> None:
        super().__init__()
        self.phase = "other"
        self.current: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak_total = 0
        self.at_peak: dict[str, int] = {}
        self._live: dict[int, tuple[int, str, weakref.ref]] = {}
        self._vision_depth = 0
        self._vision_nodes: dict[int, object] = {}
        self._kernel: tuple[str, list[int]] | None = None
        self._hooks = []
        for module in vision_modules:
            # After FSDP's own pre-forward hook: its all-gather is not vision.
            self._hooks.append(module.register_forward_pre_hook(self._enter_vision))
            self._hooks.append(
                module.register_forward_hook(self._exit_vision, with_kwargs=True)
            )

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._vision_nodes.clear()

    def in_phase(self, phase: str):
        from _harness import phase as set_phase  # benchmarks/, first on sys.path

        return set_phase(self, phase)

    def _enter_vision(self, module, args) -> None:
        self._vision_depth += 1
        module._live_memory_input_nodes = {
            id(t.grad_fn) for t in _plain_tensors(args) if t.grad_fn is not None
        }

    def _exit_vision(self, module, args, kwargs, output) -> None:
        self._vision_depth -= 1
        stop = module.__dict__.pop("_live_memory_input_nodes", set())
        for node in graph_nodes(output, stop):
            self._vision_nodes[id(node)] = node

    def _category(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            region = (
                "vision"
                if node is not None and id(node) in self._vision_nodes
                else "decoder"
            )
            return f"backward/{region}"
        region = "vision" if self._vision_depth > 0 else "decoder"
        return f"{self.phase}/{region}"

    def _add(self, nbytes: int, category: str) -> None:
        self.current[category] += nbytes
        self.total += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.at_peak = {c: b for c, b in self.current.items() if b}

    def _free(self, key: int) -> None:
        if key not in self._live:
            return
        nbytes, category, _ = self._live.pop(key)
        self.current[category] -= nbytes
        self.total -= nbytes

    def _track(self, storages: dict[int, torch.UntypedStorage], category: str):
        for key, storage in storages.items():
            if key in self._live:
                if self._live[key][2]() is not None:
                    continue
                self._free(key)  # its address was reused before the callback ran
            if self._kernel is not None:
                category = f"{self._kernel[0]}/attn_scratch"
                self._kernel[1].append(key)
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, lambda _, key=key: self._free(key))
            self._live[key] = (nbytes, category, ref)
            self._add(nbytes, category)

    def _retag(self, key: int, category: str) -> None:
        nbytes, old, ref = self._live[key]
        self.current[old] -= nbytes
        self.current[category] += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self._live[key] = (nbytes, category, ref)

    def _run_kernel(self, func, args, kwargs):
        """Run an attention HOP's eager kernel; what it allocates is scratch
        until it returns, and then its outputs belong to the caller's region."""
        if self._kernel is not None:
            return func.py_kernels[DispatchKey.CompositeExplicitAutograd](
                *args, **kwargs
            )
        category = self._category()
        self._kernel = (category, [])
        try:
            with self:
                out = func.py_kernels[DispatchKey.CompositeExplicitAutograd](
                    *args, **kwargs
                )
        finally:
            _, allocated = self._kernel
            self._kernel = None
        for key in _storages(out):
            if key in self._live and key in set(allocated):
                self._retag(key, category)
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
