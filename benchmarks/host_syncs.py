"""Host syncs: device-to-host synchronizations in one multimodal training step under CP.

A ``TorchFunctionMode`` records Python value reads (``item``, ``tolist``,
``bool()``, ...) and a ``TorchDispatchMode`` data-dependent operators
(``nonzero``, boolean indexing, copies to the host, ...), also from C++
autograd, each by phase, site (innermost torchtitan or plug-in frame) and
owner (innermost frame's package, thin torch wrappers skipped), on the real
Trainer of a CP job (default ``train_configs/cp2.toml``). Blind spots:
higher-order op bodies (flex attention) run with the modes popped;
``create_block_mask`` runs eagerly (compiled, it cannot trace under a Python
mode); on the CPU backend ``.to("cpu")`` is not told from ``.to(device)``.
Extra arguments are torchtitan flags::

    python benchmarks/host_syncs.py
    python benchmarks/host_syncs.py --seq-len 256 --warmup 0
"""

import collections
import contextlib
import os
import sys
import sysconfig
from unittest import mock

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

BATCH_GENERATOR = "batch_generator"
TARGET_PHASES = ("post_dataloading_process", "forward+backward")
OWNERS = ("torchtitan_ext", "torchtitan", "torch")

_aten = torch.ops.aten
_VALUE_READS = set("item tolist numpy cpu __bool__ __int__ __float__ __index__".split())
_DATA_DEPENDENT_OPS = {
    getattr(_aten, name).default
    for name in "_local_scalar_dense nonzero masked_select _unique _unique2 "
    "unique_dim unique_consecutive bincount equal".split()
}
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
_INDEX_OPS.add(_aten._index_put_impl_.default)
# torch's Python entry points that merely forward to an operator: a sync seen
# inside them belongs to their caller.
_TORCH_WRAPPERS = ("torch/_tensor.py", "torch/functional.py", "torch/overrides.py")
_TORCH_WRAPPERS += ("torch/utils/_python_dispatch.py", "torch/_ops.py")
_TORCH_WRAPPERS += ("torch/_dynamo/eval_frame.py", "torch/_compile.py")
_SKIPPED_FILES = {os.path.abspath(__file__), os.path.abspath(_harness.__file__)}
_STDLIB = sysconfig.get_paths()["stdlib"]
SyncSite = collections.namedtuple("SyncSite", "phase owner site op")


def _owner(path: str) -> str | None:
    """The package of ``path``; None for the standard library and ``<...>``."""
    for owner in OWNERS:
        if f"/{owner}/" in path:
            return owner
    if path.startswith(("<", _STDLIB)) and "site-packages" not in path:
        return None
    return path.rsplit("site-packages/", 1)[-1].split("/", 1)[0]


def _attribute(phase: str, op: str) -> SyncSite:
    """The owner and site of the Python stack issuing ``op``."""
    owner = site = None
    frame = sys._getframe(1)
    while frame is not None and site is None:
        path = os.path.abspath(frame.f_code.co_filename).replace(os.sep, "/")
        frame_owner = _owner(path) if path not in _SKIPPED_FILES else None
        if frame_owner is not None and not path.endswith(_TORCH_WRAPPERS):
            owner = owner or frame_owner
            if frame_owner in OWNERS[:2]:  # the plug-in or torchtitan
                file = frame_owner + "/" + path.rsplit(f"/{frame_owner}/", 1)[1]
                site = f"{file}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    if node is not None:
        op = f"{op} in backward of {node.name()}"
    return SyncSite(phase, owner or "torch", site or "-", op)


def _syncs(func, args, kwargs) -> bool:
    """Whether aten ``func`` waits for the device's data."""
    if func in _DATA_DEPENDENT_OPS:
        return True
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in indices
        )
    if func is _aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
    elif func is _aten.copy_.default:
        source, target = args[1], args[0].device
    else:
        return False
    host = target is not None and torch.device(target).type == "cpu"
    return host and source.device.type != "cpu"


class _ValueReads(TorchFunctionMode):
    """Python-level reads (``tolist`` never reaches the dispatcher)."""

    def __init__(self, recorder: "Recorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, recorder = kwargs or {}, self.recorder
        name = getattr(func, "__name__", "")
        reads = name in _VALUE_READS and args and isinstance(args[0], torch.Tensor)
        reads = reads and (recorder.on_host or args[0].device.type != "cpu")
        if recorder.in_value_read or not reads:
            return func(*args, **kwargs)
        recorder.record(f"Tensor.{name}")
        # The ops it runs are this one sync.
        with mock.patch.object(recorder, "in_value_read", True):
            return func(*args, **kwargs)


class Recorder(TorchDispatchMode):
    """Sync sites of ``trainer``'s steps by phase, and the data-dependent ops;
    its ``post_dataloading_process`` and ``fwd_bwd_fn`` are tagged with theirs."""

    supports_higher_order_operators = True  # their bodies run with the mode popped

    def __init__(self, trainer) -> None:
        super().__init__()
        self.counts: collections.Counter[SyncSite] = collections.Counter()
        self.ops_seen: collections.Counter[str] = collections.Counter()
        self.phase: str | None = None
        self.on_host = trainer.device.type == "cpu"
        self.in_value_read = False
        hooks = ("post_dataloading_process", "fwd_bwd_fn")
        for name, phase in zip(hooks, TARGET_PHASES, strict=True):
            in_phase = mock.patch.object(self, "phase", phase)  # as a decorator
            setattr(trainer, name, in_phase(getattr(trainer, name)))

    def record(self, op: str) -> None:
        if self.phase is not None:
            self.counts[_attribute(self.phase, op)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if self.phase is not None:
            self.ops_seen[self.phase] += 1
        if not self.in_value_read and _syncs(func, args, kwargs):
            self.record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    def step(self, trainer, raw_batch, on: bool = True) -> None:
        """One ``train_step`` of a dataloader batch, ``batch_generator`` first;
        syncs are recorded if ``on``."""
        with contextlib.ExitStack() as modes:
            if on:
                modes.enter_context(self), modes.enter_context(_ValueReads(self))
            with mock.patch.object(self, "phase", BATCH_GENERATOR):
                cpu_batch = next(trainer.batch_generator(iter([raw_batch])))
            batch = _harness.to_device(trainer, cpu_batch)
            with mock.patch.object(self, "phase", "rest of train_step"):
                _harness.train_step(trainer, batch)


def totals(per_rank: list[collections.Counter]) -> dict[str, dict[str, list[int]]]:
    """Phase -> owner -> each rank's count."""
    result: dict[str, dict[str, list[int]]] = {}
    for rank, counts in enumerate(per_rank):
        for site, n in counts.items():
            by_owner = result.setdefault(site.phase, {})
            by_owner.setdefault(site.owner, [0] * len(per_rank))[rank] += n
    return result


def _measure(args, trainer) -> dict:
    """This rank's sync counts, as plain data."""
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    # Eager, as cpu_backend sets it on CPU: see the module's docstring.
    _attention._compiled_create_block_mask = create_block_mask
    recorder = Recorder(trainer)
    loaded = iter(trainer.dataloader)
    for step in range(args.warmup + args.steps):
        recorder.step(trainer, next(loaded), on=step >= args.warmup)
    counts = [(tuple(site), n) for site, n in recorder.counts.items()]
    return {"counts": counts, "ops_seen": dict(recorder.ops_seen)}


def _report(args, job: dict, results: list[dict]) -> tuple[str, dict]:
    per_rank = [
        collections.Counter({SyncSite(*site): n for site, n in r["counts"]})
        for r in results
    ]
    sites = sorted(
        set().union(*per_rank), key=lambda s: (s.phase != BATCH_GENERATOR, *s)
    )
    rows = [site._asdict() | {"counts": [c[site] for c in per_rank]} for site in sites]
    targets = [site for site in sites if site.phase in TARGET_PHASES]
    in_scope = {  # per owner, each rank's count in the target phases
        owner: [sum(c[s] for s in targets if s.owner == owner) for c in per_rank]
        for owner in sorted({site.owner for site in sites} | set(OWNERS))
    }
    columns = [("phase", "{phase}"), ("owner", "{owner}"), ("site", "`{site}`")]
    columns.append(("op", "{op}"))
    columns.append(("count per rank", lambda r: ", ".join(map(str, r["counts"]))))
    lines = [
        f"host syncs in {args.steps} instrumented step(s) after {args.warmup} "
        "warm-up step(s)",
        _harness.table(columns, rows, left=[t for t, _ in columns[:-1]]),
        f"\nIn {' + '.join(TARGET_PHASES)} (per rank), by owner:",
        *(f"- {owner}: {', '.join(map(str, n))}" for owner, n in in_scope.items()),
    ]
    return "\n".join(lines), {
        "ranks": len(per_rank),
        "target_phases": list(TARGET_PHASES),
        "in_target_phases_by_owner": in_scope,
        "totals": totals(per_rank),
        "rows": rows,
        "ops_seen": [r["ops_seen"] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = _harness.job_parser(__doc__, "host_syncs.json", steps=1)
    return _harness.run_job(parser, argv, _measure, _report)


if __name__ == "__main__":
    sys.exit(main())
