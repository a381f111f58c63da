r"""The training entry of the compiled CP runs: dynamo's graph breaks and recompiles.

``--compile.enable`` here (torchtitan 0.3.0's ``apply_compile``): each block of
``model.layers`` and of ``vision_encoder.layers`` is compiled on its own with
``fullgraph=True`` (after AC wrapping, before FSDP), and with
``--compile.components`` holding ``loss`` (the default) the cross-entropy of
each chunk of the chunked loss. The vision adapter has no block stack and stays
eager (the plug-in's ``parallelize.apply_compile``, as torchtitan PR #4806).
The token embedding, the vision injection, the CP sharding and the exchange
of sharded vision run eagerly around the compiled blocks.

Backend ``aot_eager``, plain (``cpu_backend``): dynamo and AOT autograd trace
every block, flex attention included, and run the traced graphs with eager
kernels. ``inductor`` cannot train these blocks on CPU: its CPU flex attention
lowering returns the output alone, not the logsumexp the backward needs
(``InductorError: IndexError: tuple index out of range``). So the compiled runs
prove dynamo's capture, guards and recompilations and AOT autograd's joint
graph and partition against eager numerics; inductor's code generation stays
unproven on this machine.

``TRAIN_FILE=tests.compile_report TORCHTITAN_EXT_COMPILE_REPORT=<dir>
./run_train.sh ...`` trains as ``torchtitan_ext.train`` does and writes, per
rank, ``<dir>/rank<N>.json``: dynamo's graph breaks and recompilations and the
images each step's vision encoder saw. ``test_parity_cp.py`` runs the compiled
CP jobs in its packed suite and reads these reports.
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

__all__ = [
    "COMPILE",
    "REPORT_ENV",
    "VARIANT_RECOMPILES",
    "SHAPE_RECOMPILES",
    "cause",
    "main",
    "read_reports",
    "summarize",
]

REPORT_ENV = "TORCHTITAN_EXT_COMPILE_REPORT"
COMPILE = "--compile.enable --compile.backend aot_eager"
# Per rank over any number of steps (measured over 10 with the packed data,
# every job and rank alike): the AC wrapper's forward is the one code object
# of every compiled block, so each of the 5 block variants (vision blocks
# with the dense and the sparse mask, decoder layer 0, the other RoPE
# sliding-window layers, the NoPE global layers) is a cache entry of it: 4
# recompilations in step 1. In step 2 the image count changes and the two
# vision variants are recompiled with it dynamic: 2 more. None after. That is
# 7 cache entries of torch's recompile_limit of 8 per code object; under
# fullgraph=True the 9th ends the run (FailOnRecompileLimitHit).
VARIANT_RECOMPILES, SHAPE_RECOMPILES = 4, 2


def _install_report(folder: Path):
    """Record this rank's graph breaks, recompilations and images; returns the
    function that writes them."""
    import torch
    import torch._dynamo.convert_frame as convert_frame
    from torch._dynamo.utils import counters

    from torchtitan_ext.muse_glimmer.model import MuseGlimmerModel

    steps: list[dict] = []  # one entry per model forward: this rank's images
    recompiles: list[dict] = []
    limits_hit: list[dict] = []

    log_reasons = convert_frame.get_and_maybe_log_recompilation_reasons
    exceeds = convert_frame.exceeds_recompile_limit

    def _where(code) -> str:
        return f"{code.co_name} {code.co_filename}:{code.co_firstlineno}"

    def recording_reasons(cache_entries, frame, *args, **kwargs):
        reasons = log_reasons(cache_entries, frame, *args, **kwargs)
        module = frame.f_locals.get("self")
        module = getattr(module, "_checkpoint_wrapped_module", module)
        recompiles.append(
            {
                "step": len(steps),
                "function": _where(frame.f_code),
                "module": type(module).__name__,
                "cache_entries": len(cache_entries),
                # The first failed guard of each cached entry.
                "reasons": [reason.splitlines()[0] for reason in reasons],
            }
        )
        return reasons

    def recording_limit(cache_size, compile_id):
        exceeded, limit = exceeds(cache_size, compile_id)
        if exceeded:
            limits_hit.append({"step": len(steps), "limit": limit})
        return exceeded, limit

    convert_frame.get_and_maybe_log_recompilation_reasons = recording_reasons
    convert_frame.exceeds_recompile_limit = recording_limit

    forward = MuseGlimmerModel.forward
    get_vision_features = MuseGlimmerModel._get_vision_features

    def counting_forward(self, *args, **kwargs):
        steps.append({"images": []})
        return forward(self, *args, **kwargs)

    def recording_vision(self, pixel_values, grid_thw):
        steps[-1]["images"].append(
            {"pixel_values": list(pixel_values.shape), "grid_thw": grid_thw.tolist()}
        )
        return get_vision_features(self, pixel_values, grid_thw)

    MuseGlimmerModel.forward = counting_forward
    MuseGlimmerModel._get_vision_features = recording_vision

    def write() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        report = {
            "rank": int(os.environ.get("RANK", "0")),
            "steps": steps,
            "graph_breaks": dict(counters["graph_break"]),
            "recompiles": recompiles,
            "recompile_limit": torch._dynamo.config.recompile_limit,
            "limits_hit": limits_hit,
            "frames": dict(counters["frames"]),
            "unique_graphs": counters["stats"]["unique_graphs"],
        }
        path = folder / f"rank{report['rank']}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")

    return write


def main() -> None:
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    write = _install_report(Path(os.environ[REPORT_ENV]))

    from torchtitan_ext.train import main as train_main

    try:  # not atexit: a rank forked by local_ranks ends without running it
        train_main()
    finally:
        write()


def read_reports(folder: Path) -> dict[int, dict]:
    """Every rank's report of a run, by rank."""
    reports = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    return {r["rank"]: r for r in reports}


def summarize(reports: dict[int, dict]) -> list[str]:
    """One line per rank: graph breaks, recompiles by step and by cause, images."""
    lines = []
    for rank, r in sorted(reports.items()):
        by_step = Counter(e["step"] for e in r["recompiles"])
        causes = Counter(cause(e) for e in r["recompiles"])
        images = [
            [(i["pixel_values"][0], i["pixel_values"][1]) for i in s["images"]]
            for s in r["steps"]
        ]
        lines.append(
            f"rank {rank}: graph breaks {sum(r['graph_breaks'].values())} "
            f"{r['graph_breaks'] or ''}, graphs {r['unique_graphs']}, recompiles "
            f"{len(r['recompiles'])} by step {dict(sorted(by_step.items()))} "
            f"causes {dict(causes)}, limits hit {r['limits_hit']}, "
            f"images (count, max patches) per step {images}"
        )
    return lines


def cause(recompile: dict) -> str:
    """``shape`` if a cached graph of the same code failed on a size alone.

    Otherwise every cached graph failed on what tells block variants apart
    (their mask function, call signature, ``use_rope``): the first graph of
    another variant of a block that shares the compiled code object.
    """
    if any("size mismatch" in reason for reason in recompile["reasons"]):
        return "shape"
    return "variant"


if __name__ == "__main__":
    sys.exit(main())
