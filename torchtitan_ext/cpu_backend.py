"""Run the real torchtitan ``Trainer`` on a machine without an accelerator.

torchtitan 0.3.0 assumes an accelerator: with none present it picks ``"cuda"``,
and several modules copy ``device_type``/``device_module`` out of
``torchtitan.tools.utils`` when they are imported. ``apply()`` therefore has to
run before the rest of torchtitan is imported. It changes six things, and
only when no accelerator is present (on a GPU machine it returns at once):

1. ``device_type`` becomes ``"cpu"`` (gloo process groups) and ``device_module``
   a stand-in for ``torch.cpu`` with the calls the trainer and its metrics make;
   memory statistics report the process's real peak resident set size.
2. Eager (unfused) flex attention replaces the compiled one, whose inductor CPU
   path fails, and torch's CPU backward refusal is lifted: the eager kernel is
   dense and differentiable. ``set_determinism`` re-binds the compiled kernel,
   so it is wrapped to restore the eager one.
3. FSDP2 modules reduce with plain sums: torchtitan disables gradient division,
   which makes FSDP use ``PREMUL_SUM``, and gloo rejects that op. With a divide
   factor of 1.0 both are the same sum.
4. Block masks are built by eager ``create_block_mask``: the compiled one works
   but costs inductor half a minute per new shape in every process. The masks
   are the same.
5. ``--compile.backend aot_eager`` stays plain ``aot_eager``: torchtitan wraps
   it in ``regional_inductor`` for flex models, which hands the flex region to
   inductor, whose CPU flex lowering returns the output alone (no logsumexp)
   and so fails any graph that trains (``IndexError: tuple index out of
   range``). Under plain ``aot_eager`` dynamo and AOT autograd trace the flex
   op and run its dense kernels, as eager does. ``inductor`` itself fails the
   same way on CPU for the blocks (README, "torch.compile").
6. ``Trainer.train`` ends without rank 0's 2-second sleep "for other ranks to
   complete": gloo ranks have nothing left in flight, and every CPU run (the
   test suite launches about a hundred) paid the 2 s.
"""

import contextlib
import os
import platform
import resource
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "apply",
    "compiled_block_masks",
    "eager_flex_attention",
    "is_active",
    "peak_rss_bytes",
]

_active = False


def is_active() -> bool:
    """Whether ``apply()`` switched torchtitan to the CPU backend."""
    return _active


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last reset."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # ru_maxrss is in KiB on Linux and cannot be reset.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> None:
    # Writing "5" to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


@dataclass(frozen=True)
class _CpuDeviceProperties:
    name: str
    total_memory: int


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style calls torchtitan makes on its device module."""

    def __init__(self) -> None:
        super().__init__("torchtitan_ext.cpu_device_module")

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: torch.device | int | str) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        # An int, because barrier(device_ids=[...]) builds torch.device("cpu", id).
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: torch.device | int | None = None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device: torch.device | int | None = None):
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return _CpuDeviceProperties(
            name=_CpuDeviceModule.get_device_name(), total_memory=total_memory
        )

    @staticmethod
    def memory_stats(device: torch.device | int | None = None) -> dict[str, int]:
        peak = peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device: torch.device | int | None = None) -> None:
        _reset_peak_rss()

    @staticmethod
    def empty_cache() -> None:
        pass


def _has_accelerator() -> bool:
    return torch._utils._get_available_device_type() is not None


def _assert_torchtitan_not_imported() -> None:
    early = sorted(
        name
        for name in sys.modules
        if name.startswith("torchtitan.")
        and name
        not in (
            "torchtitan.tools",
            "torchtitan.tools.utils",
            "torchtitan.tools.logging",
            "torchtitan.observability",
            "torchtitan.observability.structured_logger",
        )
        and not name.startswith("torchtitan.observability.")
    )
    if early:
        raise RuntimeError(
            "torchtitan_ext.cpu_backend.apply() must run before torchtitan is "
            f"imported; already imported: {early[:5]}"
        )


def _validate_device_allowing_cpu_backward(query, key, value) -> None:
    if query.device.type not in {"cuda", "cpu", "xpu", "hpu", "mps"}:
        raise ValueError(
            "FlexAttention is only supported on CUDA, CPU, HPU, or MPS devices. "
            f"Found input tensors on {query.device.type} device."
        )


def eager_flex_attention(*args, score_mod=None, **kwargs):
    """torch's flex attention run eagerly, with neither dynamo nor inductor."""
    from torch.nn.attention import flex_attention as flex_module

    if score_mod is not None:
        # Uncompiled, tensors a score_mod captures would receive no gradient.
        raise NotImplementedError(
            "The CPU backend's eager flex attention supports masks, not score_mod."
        )
    return flex_module.flex_attention(*args, **kwargs)


def _use_eager_flex_attention() -> None:
    from torch.nn.attention import flex_attention as flex_module
    from torchtitan.models.common.attention import FlexAttention

    flex_module._validate_device = _validate_device_allowing_cpu_backward
    # Dense math kernels called directly; tracing them with dynamo on every new
    # mask and shape costs minutes per step on CPU.
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    FlexAttention._compiled_flex_attn = eager_flex_attention


def _use_eager_create_block_mask(create_block_mask=None) -> None:
    from torch.distributed.tensor.experimental._context_parallel import (
        _attention as cp_attention,
    )
    from torch.nn.attention import flex_attention
    from torchtitan.models.common import attention, vision_encoder

    create_block_mask = create_block_mask or flex_attention.create_block_mask
    attention._compiled_create_block_mask = create_block_mask
    vision_encoder.compiled_create_block_mask = create_block_mask
    # CP's per-rank mask rewrite compiles create_block_mask on first use unless
    # this cache is set: tens of seconds of inductor per CP process on CPU.
    cp_attention._compiled_create_block_mask = create_block_mask


@contextlib.contextmanager
def compiled_block_masks():
    """torchtitan's compiled ``create_block_mask`` for the ``with`` block: the
    eager one holds a dense [Q, KV] mask (and its int64 block sums: 34 GB at
    65536 tokens); the compiled one reduces blocks as it goes, at the price of
    inductor's compile per new shape."""
    import torch
    from torch._inductor import config as inductor_config
    from torch.nn.attention.flex_attention import create_block_mask

    _use_eager_create_block_mask(torch.compile(create_block_mask))
    try:  # scalar C++: inductor's vectorized document masks do not compile
        with inductor_config.patch({"cpp.simdlen": 1}):
            yield
    finally:
        _use_eager_create_block_mask()


def _keep_eager_flex_under_determinism() -> None:
    from torchtitan.distributed import utils as dist_utils

    set_determinism: Callable = dist_utils.set_determinism

    def set_determinism_with_eager_flex(*args, **kwargs) -> None:
        set_determinism(*args, **kwargs)
        _use_eager_flex_attention()

    dist_utils.set_determinism = set_determinism_with_eager_flex


def _keep_aot_eager_plain() -> None:
    from torchtitan.distributed import compile as tt_compile

    choose_backend = tt_compile._maybe_regional_inductor_backend

    def backend_without_inductor_flex(model, backend: str):
        if backend == "aot_eager":
            return backend
        return choose_backend(model, backend)

    tt_compile._maybe_regional_inductor_backend = backend_without_inductor_flex


def _skip_closing_sleep() -> None:
    from torchtitan import trainer

    # ``time`` in torchtitan/trainer.py: perf_counter, and one sleep(2) at the
    # end of ``train`` (``tests/unit/test_upstream_guards.py`` checks both).
    trainer.time = types.SimpleNamespace(
        perf_counter=time.perf_counter, sleep=lambda seconds: None
    )


def _force_sum_reduction_in_fsdp() -> None:
    from torch.distributed.fsdp import FSDPModule

    set_gradient_divide_factor = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor_with_sum(self, factor: float) -> None:
        set_gradient_divide_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor_with_sum


def apply() -> None:
    """Switch torchtitan to CPU + gloo when no accelerator is present."""
    global _active
    if _active or _has_accelerator():
        return
    _assert_torchtitan_not_imported()

    from torchtitan.tools import utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _CpuDeviceModule()

    _use_eager_flex_attention()
    _use_eager_create_block_mask()
    _keep_eager_flex_under_determinism()
    _keep_aot_eager_plain()
    _force_sum_reduction_in_fsdp()
    _skip_closing_sleep()
    _active = True
