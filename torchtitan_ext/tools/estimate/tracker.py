"""torch's memory trackers, with forward activations filed by model region.

``MemTracker`` (and its FSDP2 subclass ``FSDPMemTracker``) files every storage
an op creates, fake tensors included, by kind and keeps the breakdown at the
peak. The regions are ``benchmarks/memory_per_rank.py``'s, so the two compare:
an activation created within ``in_forward()`` outside the autograd engine (the
chunked loss runs each chunk's backward inside its forward: those are backward
temporaries) is ``vision`` while a vision module runs, else ``decoder``; none
inside FSDP's pre-forward hook (its all-gather output and unsharded parameters
are parameters: 3.5 GiB of "decoder activations" for the 30B vision encoder's
unit otherwise).

Two changes to the trackers' bookkeeping. DTensor's sharding propagation makes
fake tensors of the *global* shape in the active fake mode, which the trackers
took for allocations (111 GiB of "activations" in ``clip_grad_norm_`` on the
30B model): nothing inside that call is tracked. And each chunk's backward in
the chunked loss resets ``ModTracker``'s module stack, so the trackers take
the next ``lm_head`` call for a new iteration and raise ("multiple iterative
calls"): a stand-in parent allows it. These private torch names have no
public equivalent; ``tests/unit/test_upstream_guards.py`` guards each.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPState
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_flatten

__all__ = ["FORWARD_DECODER", "FORWARD_VISION", "RegionTracker", "region_tracker"]

_REPEATED_CALL = "<a module called again in the same forward>"

FORWARD_DECODER = "forward/decoder"
FORWARD_VISION = "forward/vision"


def _by_kind(snapshot: dict) -> dict[str, int]:
    return {getattr(k, "value", k): n for k, n in snapshot.items() if k != _TOTAL_KEY}


class _Regions:
    """The region accounting, mixed into a ``MemTracker`` class."""

    # Flex attention is a higher-order operator: let it reach the fake mode.
    supports_higher_order_operators = True

    def _init_regions(self, vision_modules: Iterable[nn.Module]) -> None:
        self.region_current: dict[str, int] = defaultdict(int)
        self.region_peak: dict[str, int] = defaultdict(int)
        self.retained = 0  # activations alive when the forward ended
        self._vision_depth = 0
        self._forward = False
        self._hooks = []
        for module in vision_modules:  # after FSDP's: its all-gathers are not vision
            self._hooks.append(module.register_forward_pre_hook(self._enter_vision))
            self._hooks.append(
                module.register_forward_hook(self._exit_vision, always_call=True)
            )

    def __enter__(self):
        propagate = self._propagate = (
            ShardingPropagator._propagate_tensor_meta_non_cached
        )
        self._untracked = 0

        @functools.wraps(propagate)
        def untracked(propagator, *args, **kwargs):
            self._untracked += 1
            try:
                return propagate(propagator, *args, **kwargs)
            finally:
                self._untracked -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = untracked
        return super().__enter__()

    def __exit__(self, *args) -> None:
        try:
            super().__exit__(*args)
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
            for hook in self._hooks:
                hook.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._untracked:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    @contextlib.contextmanager
    def in_forward(self) -> Iterator[None]:
        """Activations created in this block are filed by region."""
        self._forward = True
        try:
            yield
        finally:
            self._forward = False

    def end_forward(self) -> None:
        """Record the activations the forward leaves alive for the backward."""
        self.retained = sum(self.region_current.values())

    def _enter_vision(self, module, args) -> None:
        self._vision_depth += 1

    def _exit_vision(self, module, args, output) -> None:
        self._vision_depth -= 1

    @contextlib.contextmanager
    def _repeatable_call(self) -> Iterator[None]:
        parents = self._mod_tracker.parents
        parents.add(_REPEATED_CALL)
        try:
            yield
        finally:
            parents.discard(_REPEATED_CALL)

    def _region(self) -> str | None:
        if not self._forward or torch._C._current_graph_task_id() != -1:
            return None
        if getattr(self, "_fsdp_state", None) is _FSDPState.PRE_FW:
            return None  # FSDP's all-gather buffers and unsharded parameters
        return FORWARD_VISION if self._vision_depth > 0 else FORWARD_DECODER

    def _add_to_region(self, region: str, nbytes: int) -> None:
        self.region_current[region] += nbytes
        self.region_peak[region] = max(
            self.region_peak[region], self.region_current[region]
        )

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        activation = self._ref_class.ACT
        region = getattr(winfo, "region", None)
        if u_type == _UpdateType.ADD and winfo.reftype == activation:
            winfo.region = self._region()
            if winfo.region is not None:
                self._add_to_region(winfo.region, winfo.mem_consumed)
        elif region is None:
            return
        elif u_type == _UpdateType.DEL:
            self._add_to_region(region, -winfo.mem_consumed)
        elif u_type == _UpdateType.SIZE:
            self._add_to_region(region, winfo.mem_consumed - old_mem_consumed)
        elif u_type == _UpdateType.REF and winfo.reftype != activation:
            # Re-filed away from activations: it leaves its region.
            self._add_to_region(region, -winfo.mem_consumed)
            winfo.region = None

    def track_batch(self, batch) -> None:
        """File the prepared batch's tensors as inputs, before the step: views
        of them are then no new activations (``pixel_values``' are, else)."""
        kinds = self._ref_class.__members__
        kind = kinds["INP"] if "INP" in kinds else kinds["OTH"]
        for tensor in tree_flatten(batch)[0]:
            if isinstance(tensor, torch.Tensor):
                self._update_and_maybe_create_winfos(tensor, kind)

    def live_bytes(self) -> dict[str, int]:
        """Live bytes by kind (``MemTracker``'s reference types), all devices."""
        live = Counter()
        for snapshot in self.get_tracker_snapshot("current").values():
            live.update(_by_kind(snapshot))
        return dict(live)

    def peak_bytes(self) -> tuple[int, dict[str, int]]:
        """The peak of all live bytes, and its breakdown by kind."""
        peak = max(
            self.get_tracker_snapshot("peak").values(),
            key=lambda snapshot: snapshot.get(_TOTAL_KEY, 0),
            default={},
        )
        return peak.get(_TOTAL_KEY, 0), _by_kind(peak)


class _PlainRegionTracker(_Regions, MemTracker):
    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        with self._repeatable_call():
            super()._pre_fw_hook(module, inputs)


class _FSDPRegionTracker(_Regions, FSDPMemTracker):
    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        pre_forward = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        @functools.wraps(pre_forward)
        def repeatable(*args, **kwargs):
            with self._repeatable_call():
                return pre_forward(*args, **kwargs)

        return repeatable


RegionTracker = _PlainRegionTracker | _FSDPRegionTracker


def region_tracker(
    model_part: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    vision_modules: Iterable[nn.Module],
) -> RegionTracker:
    """The tracker of one model part and its optimizers' (existing) state:
    ``FSDPMemTracker`` when FSDP wraps the part, else the plain ``MemTracker``."""
    if isinstance(model_part, FSDPModule):
        tracker = _FSDPRegionTracker(model_part)
    else:
        tracker = _PlainRegionTracker()
        tracker.track_external(model_part)
    tracker._init_regions(vision_modules)
    for optimizer in optimizers:
        tracker._track_optimizer_states(tracker._ref_class.OPT, optimizer)
    return tracker
