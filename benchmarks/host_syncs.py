"""Host syncs: device-to-host synchronizations in one multimodal training step under CP.

On the real ``MuseGlimmerTrainer`` of a CP job (default
``train_configs/cp2.toml``, 2 ranks), after ``--warmup`` uninstrumented steps,
``--steps`` steps run under two modes that record every operation that makes
the host wait for the device, with the Python stack that issued it:

- Python-level reads of a tensor's value (``TorchFunctionMode``): ``item``,
  ``tolist``, ``numpy``, ``cpu``, ``bool()``, ``int()``, ``float()``, and
  indexing with a 0-d tensor (``__index__``/``_local_scalar_dense``);
- operators whose output size or value depends on data (``TorchDispatchMode``),
  also when issued from C++ (autograd): ``_local_scalar_dense``, ``nonzero``,
  ``masked_select``, ``unique``, ``bincount``, ``equal``, ``repeat_interleave``
  without ``output_size``, indexing with a boolean mask, and ``_to_copy`` or
  ``copy_`` from an accelerator to the host.

Each record is attributed to its site, the innermost frame of torchtitan or
the plug-in (file:line), and to an owner, the package of the innermost frame
that is not a thin torch API wrapper (so a sync inside torch called from
torchtitan is torch's, via torchtitan's line). Phases:

- ``batch_generator``: ``MuseGlimmerTrainer.batch_generator`` on a batch the
  dataloader already made (the plug-in's ``check_vision_placeholders`` reads
  the CPU batch here: host reads, not device syncs, reported apart);
- ``post_dataloading_process`` and ``forward+backward``: the target scope;
- ``rest of train_step``: token counting, clipping, optimizer, loss logging,
  for reference.

Blind spots, reported as such: the bodies of higher-order ops (flex
attention forward and backward) run with the modes popped. torch's CP
block-mask rewrite compiles ``create_block_mask`` with ``fullgraph=True``,
which cannot trace under a Python mode, so here it runs eagerly (same masks,
``_harness.use_eager_cp_block_masks``) and is instrumented. On the CPU backend
every tensor lives on the host, so Python-level reads count whatever the
tensor (``.to("cpu")`` is not counted: it cannot be told from
``.to(trainer.device)``); with an accelerator only reads of device tensors
count. Started as a plain script it runs itself on ``--nproc`` local ranks;
extra arguments are torchtitan flags::

    python benchmarks/host_syncs.py
    python benchmarks/host_syncs.py --seq-len 256 --warmup 0
"""

import argparse
import collections
import contextlib
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

BATCH_GENERATOR = "batch_generator"
POST_PROCESS = "post_dataloading_process"
FORWARD_BACKWARD = "forward+backward"
REST_OF_STEP = "rest of train_step"
TARGET_PHASES = (POST_PROCESS, FORWARD_BACKWARD)
OWNERS = ("torchtitan_ext", "torchtitan", "torch")

_aten = torch.ops.aten
# ``.to("cpu")`` is left to the dispatch mode (``_to_copy`` off an accelerator):
# on the CPU backend it cannot be told from ``.to(trainer.device)``.
_VALUE_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"}
_VALUE_READS |= {"__index__"}
_DATA_DEPENDENT_OPS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.bincount.default,
    _aten.equal.default,
}
_INDEX_OPS = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default}
# torch's Python entry points that merely forward to an operator: a sync seen
# inside them belongs to their caller.
_TORCH_WRAPPERS = ("torch/_tensor.py", "torch/functional.py", "torch/overrides.py")
_TORCH_WRAPPERS += ("torch/utils/_python_dispatch.py", "torch/_ops.py")
_TORCH_WRAPPERS += ("torch/_dynamo/eval_frame.py", "torch/_compile.py")
_SKIPPED_FILES = {os.path.abspath(__file__), os.path.abspath(_harness.__file__)}
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class SyncSite:
    phase: str
    owner: str
    site: str
    via: str
    op: str


def _owner(filename: str) -> str | None:
    path = filename.replace(os.sep, "/")
    for owner, marker in (
        ("torchtitan_ext", "/torchtitan_ext/"),
        ("torchtitan", "/torchtitan/"),
        ("torch", "/torch/"),
    ):
        if marker in path:
            return owner
    if path.startswith(("<", _STDLIB)) and "site-packages" not in path:
        return None
    return path.rsplit("site-packages/", 1)[-1].split("/", 1)[0]


def _short(filename: str, lineno: int, function: str) -> str:
    path = filename.replace(os.sep, "/")
    for marker in ("/torchtitan_ext/", "/torchtitan/", "/torch/", "site-packages/"):
        if marker in path:
            path = marker.strip("/").split("/")[-1] + "/" + path.rsplit(marker, 1)[1]
            break
    return f"{path}:{lineno} ({function})"


def _attribute(phase: str, op: str) -> SyncSite:
    """The owner, site and innermost frame of the Python stack issuing ``op``."""
    owner = site = via = None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        filename = os.path.abspath(code.co_filename)
        frame_owner = _owner(filename) if filename not in _SKIPPED_FILES else None
        wrapper = filename.replace(os.sep, "/").endswith(_TORCH_WRAPPERS)
        if frame_owner is not None and not wrapper:
            where = _short(filename, frame.f_lineno, code.co_name)
            if owner is None:
                owner, via = frame_owner, where
            if frame_owner in ("torchtitan_ext", "torchtitan"):
                site = where
                break
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    if node is not None:
        op = f"{op} in backward of {node.name()}"
    owner = owner or "torch"
    return SyncSite(phase, owner, site or "-", via if via != site else "", op)


def _is_host_device(device) -> bool:
    if isinstance(device, torch.device | str):
        return torch.device(device).type == "cpu"
    return False


class _Recorder:
    """Counts sync sites; the modes below feed it."""

    def __init__(self, device: torch.device) -> None:
        self.counts: collections.Counter[SyncSite] = collections.Counter()
        self.phase: str | None = None
        self.on_host = device.type == "cpu"
        self.unrecorded: collections.Counter[str] = collections.Counter()
        self.ops_seen: collections.Counter[str] = collections.Counter()
        self._in_value_read = False

    def in_phase(self, phase: str):
        return _harness.phase(self, phase)

    def summary(self) -> dict:
        """Plain data, to travel between processes."""
        return {
            "counts": [
                (tuple(asdict(site).values()), n) for site, n in self.counts.items()
            ],
            "unrecorded": dict(self.unrecorded),
            "ops_seen": dict(self.ops_seen),
        }

    def record(self, op: str) -> None:
        if self.phase is not None:
            self.counts[_attribute(self.phase, op)] += 1

    def reads_device(self, name: str, args) -> bool:
        """Whether ``Tensor.<name>(*args)`` copies device data to the host."""
        if name not in _VALUE_READS or not args:
            return False
        tensor = args[0]
        return isinstance(tensor, torch.Tensor) and (
            self.on_host or tensor.device.type != "cpu"
        )


class _ValueReads(TorchFunctionMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorder = self.recorder
        name = getattr(func, "__name__", "")
        if recorder._in_value_read or not recorder.reads_device(name, args):
            return func(*args, **kwargs)
        recorder.record(f"Tensor.{name}")
        recorder._in_value_read = True  # the ops it runs are this one sync
        try:
            return func(*args, **kwargs)
        finally:
            recorder._in_value_read = False


class _DataDependentOps(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            # Its body runs with this mode popped: counted as unrecorded.
            self.recorder.unrecorded[f"{func.name()} (higher-order op body)"] += 1
            return func(*args, **kwargs)
        if self.recorder.phase is not None:
            self.recorder.ops_seen[self.recorder.phase] += 1
        if not self.recorder._in_value_read and _syncs(func, args, kwargs):
            self.recorder.record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


def _syncs(func, args, kwargs) -> bool:
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
    if func in _COPY_OPS:
        source = args[0] if func is _aten._to_copy.default else args[1]
        target = kwargs.get("device") if func is _aten._to_copy.default else args[0]
        if func is _aten.copy_.default:
            target = target.device
        return source.device.type != "cpu" and _is_host_device(target)
    return False


@contextlib.contextmanager
def recording(recorder: _Recorder):
    with _DataDependentOps(recorder), _ValueReads(recorder):
        yield


def _instrument(trainer, recorder: _Recorder) -> None:
    """Tag ``post_dataloading_process`` and ``fwd_bwd_fn`` calls with their phase."""
    post_process, fwd_bwd = trainer.post_dataloading_process, trainer.fwd_bwd_fn

    def post_process_in_phase(*args, **kwargs):
        with recorder.in_phase(POST_PROCESS):
            return post_process(*args, **kwargs)

    def fwd_bwd_in_phase(*args, **kwargs):
        with recorder.in_phase(FORWARD_BACKWARD):
            return fwd_bwd(*args, **kwargs)

    trainer.post_dataloading_process = post_process_in_phase
    trainer.fwd_bwd_fn = fwd_bwd_in_phase


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _harness.add_job_arguments(parser)
    parser.add_argument("--steps", type=int, default=1, help="instrumented steps")
    parser.add_argument(
        "--json", type=Path, default=Path("outputs/benchmarks/host_syncs.json")
    )
    args, extra = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(
            f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and "
            f"{args.warmup}"
        )
    return args, extra


def _worker(args: argparse.Namespace, extra: list[str]) -> tuple[dict, dict]:
    """This rank's sync counts, and the job it ran."""
    trainer = _harness.build_job_trainer(args, extra, args.steps, "host_syncs_run")
    try:
        recorder = _Recorder(trainer.device)
        _instrument(trainer, recorder)
        _harness.use_eager_cp_block_masks()
        loaded = iter(trainer.dataloader)
        for step in range(args.warmup + args.steps):
            raw_batch = next(loaded)
            with contextlib.ExitStack() as stack:
                if step >= args.warmup:
                    stack.enter_context(recording(recorder))
                with recorder.in_phase(BATCH_GENERATOR):
                    cpu_batch = next(trainer.batch_generator(iter([raw_batch])))
                batch = _harness.to_device(trainer, cpu_batch)
                with recorder.in_phase(REST_OF_STEP):
                    _harness.train_step(trainer, batch)
        return recorder.summary(), _harness.job_summary(trainer)
    finally:
        trainer.close()


def _rows(per_rank: list[dict[SyncSite, int]]) -> list[dict]:
    sites = sorted(
        set().union(*per_rank),
        key=lambda s: (s.phase != BATCH_GENERATOR, s.phase, s.owner, s.site, s.op),
    )
    return [
        asdict(site) | {"counts": [counts.get(site, 0) for counts in per_rank]}
        for site in sites
    ]


def _totals(rows: list[dict], ranks: int) -> dict[str, dict[str, list[int]]]:
    totals: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        by_owner = totals.setdefault(row["phase"], {})
        counts = by_owner.setdefault(row["owner"], [0] * ranks)
        for rank, count in enumerate(row["counts"]):
            counts[rank] += count
    return totals


def _table(rows: list[dict]) -> str:
    lines = [
        "| phase | owner | site | via | op | count per rank |",
        "| --- | --- | --- | --- | --- | ---: |",
    ]
    for r in rows:
        via = f"`{r['via']}`" if r["via"] else ""
        lines.append(
            f"| {r['phase']} | {r['owner']} | `{r['site']}` | {via} | {r['op']} | "
            f"{', '.join(map(str, r['counts']))} |"
        )
    return "\n".join(lines)


def _report(args, extra, job: dict, summaries: list[dict]) -> None:
    per_rank = [
        {SyncSite(*site): n for site, n in summary["counts"]} for summary in summaries
    ]
    rows = _rows(per_rank)
    totals = _totals(rows, len(per_rank))
    in_scope = {
        owner: [
            sum(
                totals.get(phase, {}).get(owner, [0] * len(per_rank))[rank]
                for phase in TARGET_PHASES
            )
            for rank in range(len(per_rank))
        ]
        for owner in sorted({r["owner"] for r in rows} | set(OWNERS))
    }
    print(
        f"\n{args.config_file}: cp {job['cp']}, seq_len {job['seq_len']}, local "
        f"batch {job['local_batch_size']}, {job['device']}; host syncs in "
        f"{args.steps} instrumented step(s) after {args.warmup} warm-up step(s)"
    )
    print(_table(rows))
    print(f"\nIn {' + '.join(TARGET_PHASES)} (per rank), by owner:")
    for owner, counts in in_scope.items():
        print(f"- {owner}: {', '.join(map(str, counts))}")
    for what, calls in summaries[0]["unrecorded"].items():
        print(f"- not instrumented (rank 0): {calls} call(s) of {what}")
    _harness.write_json(
        args.json,
        {
            "args": vars(args) | {"torchtitan_args": extra},
            **job,
            "ranks": len(per_rank),
            "target_phases": list(TARGET_PHASES),
            "in_target_phases_by_owner": in_scope,
            "totals": totals,
            "rows": rows,
            "unrecorded_calls": [s["unrecorded"] for s in summaries],
            "ops_seen": [s["ops_seen"] for s in summaries],
        },
    )


def main(argv: list[str] | None = None) -> int:
    return _harness.run_job(_parse(argv), _worker, _report)


if __name__ == "__main__":
    sys.exit(main())
