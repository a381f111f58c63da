"""One CUDA GPU, under 8 minutes, one JSON: what the CPU benchmarks cannot measure.

Each section is a subprocess with a time limit, all within ``--budget-s``; one
that fails leaves an ``error`` beside what it had saved (README: "A GPU
acceptance check"). ``one_rank_*``: ``train_configs/default.toml`` against
torchtitan's ``muse_glimmer_debugmodel_mm`` (square images, which #4244 leaves
alone), real 1-rank Trainers with compiled flex attention; their host syncs
come last, from 4-token images (dynamo does not compile under the recorder,
and eager flex attention would hold large images' scores). ``real_step``: the
planned job's first rank on the fake process group, materialised on the GPU.

    python benchmarks/gpu_check.py            # outputs/benchmarks/gpu_check.json
    python benchmarks/gpu_check.py --dry-run  # no GPU: jobs built, plan printed
"""

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _harness import REPO

ONE_RANK = {"one_rank_plugin": "plugin", "one_rank_upstream": "upstream"}
IN_TURN = (*ONE_RANK, "real_step")  # on the GPU, one after another
BESIDE = ("planned", "injection")  # on the CPU, from the start
LIMITS_S = {"one_rank_plugin": 140, "one_rank_upstream": 110, "real_step": 200}
LIMITS_S |= {"planned": 460, "injection": 300}
SYNC_TOKENS_PER_IMAGE = 4


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _harness.row_parser(
        __doc__, seq_len=8192, images=[1, 64], tokens=64, json="gpu_check.json"
    )
    add = parser.add_argument
    add("--dry-run", action="store_true", help="build the jobs, print the plan")
    add("--budget-s", type=float, default=460, help="for all sections")
    add("--warmup", type=int, default=2, help="untimed steps per image count")
    add("--steps", type=int, default=10, help="timed steps per image count")
    add("--injection-args", default="--images 1 16 64 --dims 256 6656 --repeats 3")
    add("--planner-config-file", default="train_configs/30b_mm_fsdp4_cp4_tp2_sp.toml")
    add("--planner-args", default="", help="the planned job's torchtitan flags")
    add("--planner-images", type=int, default=64, help="per row")
    add("--real-steps", type=int, default=2)
    add("--section", choices=IN_TURN, help=argparse.SUPPRESS)
    add("--section-out", type=Path, help=argparse.SUPPRESS)
    return _harness.parse_row(parser, argv)  # the images checked to fit


def _plan(args, argv: list[str], folder: Path) -> dict:
    """Each section's command, environment and time limit."""
    from torchtitan_ext.tools.local_ranks import free_port

    py, out = sys.executable, {name: str(folder / f"{name}.json") for name in LIMITS_S}
    commands = {
        name: [py, __file__, *argv, "--section", name, "--section-out", out[name]]
        for name in IN_TURN
    }
    commands["planned"] = [py, "-m", "torchtitan_ext.tools.estimate", "--json"]
    commands["planned"] += [out["planned"], "--config-file", args.planner_config_file]
    commands["planned"] += ["--images", str(args.planner_images)]
    commands["planned"] += shlex.split(args.planner_args)
    commands["injection"] = [py, "benchmarks/vision_injection.py", "--json"]
    commands["injection"] += [out["injection"], *shlex.split(args.injection_args)]
    env = {"planned": {"CUDA_VISIBLE_DEVICES": ""}}
    for name in ONE_RANK:  # a world of one, as torchrun would set it (no agent)
        env[name] = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        env[name] |= {"LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        env[name]["MASTER_PORT"] = str(free_port())
    return {
        name: {"command": command, "env": env.get(name, {}), "limit_s": LIMITS_S[name]}
        for name, command in commands.items()
    }


def _start(name: str, section: dict, folder: Path) -> tuple:
    (folder / f"{name}.json").unlink(missing_ok=True)
    with open(folder / f"{name}.log", "w") as log:
        command, env = section["command"], os.environ | section["env"]
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True
        )  # a session of its own: killed with any child
    return name, proc, time.monotonic() + section["limit_s"]


def _finish(run: tuple, folder: Path, deadline: float) -> dict:
    """The section's JSON and its error: None, or why and its log's end."""
    name, proc, end = run
    try:
        code = proc.wait(max(min(end, deadline) - time.monotonic(), 0))
        error = f"exit code {code}" if code else None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        error = "out of time"
    if error:
        error += ": ..." + (folder / f"{name}.log").read_text(errors="replace")[-3000:]
    out = folder / f"{name}.json"
    result = json.loads(out.read_text()) if out.exists() else None
    return {"error": error, "result": result}


def _ratios(sections: dict) -> dict:
    """Plug-in over upstream per image count; the real steps over the planned peak."""
    plugin, upstream = ((sections[n]["result"] or {}).get("rows", []) for n in ONE_RANK)
    keys = ("tokens_per_s", "max_allocated_bytes", "max_reserved_bytes")
    theirs = {row["images"]: row for row in upstream if keys[-1] in row}
    real = sections["real_step"]["result"] or {}
    planned = (sections["planned"]["result"] or {}).get("rows", [])
    peak = next((r["peak"] for r in planned if r["rank"] == real.get("rank")), None)
    return {
        "plugin / upstream": [
            {"images": row["images"]}
            | {key: row[key] / theirs[row["images"]][key] for key in keys}
            for row in plugin
            if row["images"] in theirs and keys[-1] in row
        ],
        "real step / planned peak": [
            {key: step[key] / peak for key in keys[1:]}
            for step in real.get("steps", [])
            if peak and keys[-1] in step
        ],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    if args.section:
        _run_section(args)  # exits
    folder = args.json.parent / "gpu_check_logs"
    plan = _plan(args, [arg for arg in argv if arg != "--dry-run"], folder)
    if args.dry_run:
        print(json.dumps(_dry_run(args, plan), indent=2))
        return 0
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA device; --dry-run runs without one")
    folder.mkdir(parents=True, exist_ok=True)
    start, sections = time.monotonic(), {}
    deadline = start + args.budget_s
    beside = [_start(name, plan[name], folder) for name in BESIDE]
    for name in IN_TURN:
        sections[name] = _finish(_start(name, plan[name], folder), folder, deadline)
    for run in beside:
        sections[run[0]] = _finish(run, folder, deadline)
    report = {"argv": argv, "wall_s": round(time.monotonic() - start)}
    report |= {"ratios": _ratios(sections), "sections": sections}
    args.json.write_text(json.dumps(report, indent=2))
    for name, section in sections.items():
        print(f"{name}: {(section['error'] or 'ok')[:300]}")
    print(json.dumps(report["ratios"], indent=2), f"\nJSON: {args.json}")
    return 0


def _run_section(args) -> None:
    """A section's worker; what it saves survives its end or a timeout."""
    saved, tmp = {}, args.section_out.with_suffix(".tmp")

    def save(**values) -> None:
        saved.update(values)
        tmp.write_text(json.dumps(saved, indent=2))
        tmp.replace(args.section_out)

    save(device=torch.cuda.get_device_name())
    if args.section in ONE_RANK:
        _one_rank(args, ONE_RANK[args.section], save)
    else:
        _real_step(args, save)
    # Skip the interpreter's teardown: it has aborted in a C++ destructor.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reset_peaks() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _peaks() -> dict:
    return {
        "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def _one_rank_job(args, side: str, dump: str) -> list[str]:
    """The side's torchtitan flags: the plug-in's job or torchtitan's flavor."""
    job = ["--job.config_file", str(REPO / "train_configs/default.toml")]
    if side == "upstream":
        from torchtitan_ext.embedded_data import ensure_embedded_assets

        assets = ensure_embedded_assets()
        job = ["--module", "muse_glimmer", "--config", "muse_glimmer_debugmodel_mm"]
        job += ["--hf_assets_path", str(assets.tokenizer_dir)]
        job += ["--dataloader.dataset_path", str(assets.dataset_dir)]
    steps = len(args.images) * (args.warmup + args.steps + 1)
    job += ["--training.seq_len", str(args.seq_len), "--dump_folder", dump]
    job += ["--training.local_batch_size", "1", "--training.steps", str(steps)]
    return job + ["--metrics.log_freq", str(steps + 1)]  # logging resets the peaks


def _one_rank(args, side: str, save) -> None:
    import host_syncs
    from _vision_modes import with_vision_share
    from torchtitan.models.common.attention import FlexAttention

    compiled = hasattr(FlexAttention._compiled_flex_attn, "_torchdynamo_orig_callable")
    save(side=side, flex_compiled=compiled)
    with tempfile.TemporaryDirectory() as dump:
        trainer = _harness.build_trainer(_one_rank_job(args, side, dump))
        recorder = host_syncs.Recorder(trainer)  # counts only in its steps

        def batch(images: int, tokens: int):
            model = trainer.model_config
            return _harness.synthetic_batch(model, args.seq_len, images, tokens)

        def step(batch) -> float:  # ms of train_step; the batch checked before
            return _harness.train_step(trainer, with_vision_share(trainer, batch))

        rows = []
        try:
            for images in args.images:
                row_batch = batch(images, args.tokens_per_image)
                for _ in range(args.warmup):
                    step(row_batch)
                _reset_peaks()
                ms = statistics.median(step(row_batch) for _ in range(args.steps))
                row = {"images": images, "step_ms": ms}
                rows.append(row | {"tokens_per_s": args.seq_len / ms * 1e3} | _peaks())
                save(rows=rows)
            for row in rows:  # last: dynamo does not compile under the recorder
                recorder.counts.clear()
                recorder.step(trainer, batch(row["images"], SYNC_TOKENS_PER_IMAGE))
                totals = host_syncs.totals([recorder.counts]).items()
                row["host_syncs"] = {  # phase -> owner (plug-in, torchtitan, torch)
                    p: {owner: n for owner, (n,) in o.items()} for p, o in totals
                }
                save(rows=rows)
        finally:
            trainer.close()
            torch.distributed.destroy_process_group()


def _planner_job(args):
    """The planned job, the planner's batch, world size and first planned rank,
    as ``tools.estimate.cli.plan_job`` has them (a job without PP)."""
    from torchtitan_ext.config_file import load_job
    from torchtitan_ext.tools.estimate.planner import ranks_to_plan
    from torchtitan_ext.tools.simulated_cluster import job_world_size

    job = ["--job.config_file", str(REPO / args.planner_config_file)]
    config = load_job(job + shlex.split(args.planner_args))
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ValueError("the real step runs one model part: a job without PP")
    world, model = job_world_size(config), config.model_spec.model
    rows, seq_len = config.training.local_batch_size, config.training.seq_len
    batch = _harness.synthetic_batch(model, seq_len, args.planner_images, None, rows)
    return config, batch, world, ranks_to_plan(config, world, batch[0]["grid_thw"])[0]


def _real_step(args, save) -> None:
    from torchtitan.distributed import utils as dist_utils

    from torchtitan_ext.tools.estimate import planner
    from torchtitan_ext.tools.simulated_cluster import simulated_rank

    config, batch, world, rank = _planner_job(args)
    steps = []
    save(rank=rank, steps=steps)
    with simulated_rank(config, rank=rank, world_size=world) as simulated:
        hooks = planner._hooks_trainer(simulated)  # on torchtitan's device: cuda
        checked = next(hooks.batch_generator([batch]))  # checked on the CPU
        inputs, labels, kwargs = hooks.post_dataloading_process(
            *_harness.to_device(hooks, checked)
        )
        (part,) = simulated.model_parts
        part.to_empty(device=hooks.device)  # values do not change memory
        part.train()
        optimizers = simulated.config.optimizer.build(model_parts=[part])
        planner._create_optimizer_state(optimizers)
        debug, parallelism = simulated.config.debug, simulated.config.parallelism
        context = dist_utils.get_spmd_context(
            parallel_dims=simulated.parallel_dims,
            spmd_typechecking=debug.spmd_typechecking
            and parallelism.spmd_backend == "spmd_types",
        )
        untracked = types.SimpleNamespace(
            in_forward=contextlib.nullcontext, end_forward=lambda: None
        )
        save(allocated_before_step_bytes=torch.cuda.memory_allocated())
        for _ in range(args.real_steps):
            _reset_peaks()
            start = time.perf_counter()
            step_inputs = (optimizers, inputs, labels, kwargs)
            planner._train_step(simulated, context, untracked, *step_inputs)
            torch.cuda.synchronize()
            steps.append({"seconds": time.perf_counter() - start} | _peaks())
            save(steps=steps)


def _dry_run(args, plan: dict) -> dict:
    """The plan, each job built as its section builds it (short of the model)."""
    with tempfile.TemporaryDirectory() as dump:
        for name, side in ONE_RANK.items():
            config = _harness.load_config(_one_rank_job(args, side, dump))
            plan[name]["trainer"] = type(config).__qualname__
            plan[name]["model"] = type(config.model_spec.model).__module__
    from torchtitan_ext.muse_glimmer.config_checks import check_job_config

    config, batch, world, rank = _planner_job(args)
    check_job_config(config, world)
    images, seq_len = len(batch[0]["grid_thw"]), config.training.seq_len
    plan["real_step"]["job"] = (
        f"rank {rank} of {world}, seq_len {seq_len}, {images} images"
    )
    return plan


if __name__ == "__main__":
    sys.exit(main())
