"""Where the plug-in replaces an upstream function whole, notice upstream changes."""

import ast
import difflib
import hashlib
import importlib.metadata
import importlib.util
import inspect
import textwrap
import traceback
import types
from pathlib import Path

import pytest
import torchtitan
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torchtitan.distributed import compile as upstream_compile
from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh
from torchtitan.models.muse_glimmer import parallelize as upstream_parallelize
from torchtitan.models.muse_glimmer import vision_encoder as upstream_vision_encoder

from torchtitan_ext.muse_glimmer import parallelize as plugin_parallelize
from torchtitan_ext.muse_glimmer import vision_encoder as plugin_vision_encoder
from torchtitan_ext.muse_glimmer.config_checks import check_job_config
from torchtitan_ext.tools.simulated_cluster import simulated_rank

from ..jobs import train_config

# torchtitan 0.3.0's parallelize_muse_glimmer, which the plug-in runs rebuilt
# without its CP refusal: its file under torchtitan/, its first line and the
# sha256 of its source (inspect.getsource's text).
_PARALLELIZE_030 = (
    "models/muse_glimmer/parallelize.py",
    30,
    "e8cefb80e94c531301cae892a34a94803169b68e9dec46cb5912d8d312dfb055",
)


def _source_pin(function) -> tuple[str, int, str]:
    lines, first_line = inspect.getsourcelines(function)
    path = Path(inspect.getsourcefile(function))
    relative = path.relative_to(Path(torchtitan.__file__).parent).as_posix()
    return relative, first_line, hashlib.sha256("".join(lines).encode()).hexdigest()


def test_upstream_parallelize_is_the_pinned_030_source():
    """The plug-in adopts whatever the installed function holds: a change
    anywhere in it fails here, to be re-checked before it runs under CP."""
    pin = _source_pin(upstream_parallelize.parallelize_muse_glimmer)
    assert pin == _PARALLELIZE_030, (
        f"torchtitan's parallelize_muse_glimmer (file, first line, sha256) is {pin}, "
        f"not 0.3.0's {_PARALLELIZE_030}. The plug-in runs it rebuilt without its "
        "CP refusal; re-check what changed against UPSTREAM.md (parallelize.py): "
        "the refusal (still one `if parallel_dims.cp_enabled: raise`? gone because "
        "upstream allows CP: drop the rebuild), the apply_compile calls the plug-in "
        "redirects (drop its wrapper once #4806 is in), the TP, AC, compile, FSDP "
        "order and FSDP's (dp_shard, cp) mesh that sharding.py's vision layouts "
        "rely on; then re-pin _PARALLELIZE_030."
    )


def _upstream_refusal(tree: ast.Module) -> tuple[ast.AST, ast.If]:
    """The one ``if parallel_dims.cp_enabled`` in ``tree``, and its parent."""
    found = [
        (node, statement)
        for node in ast.walk(tree)
        for statement in getattr(node, "body", [])
        if isinstance(statement, ast.If)
        and ast.unparse(statement.test) == plugin_parallelize.CP_REFUSAL
    ]
    assert len(found) == 1, found
    return found[0]


def test_parallelize_is_upstreams_minus_its_one_cp_refusal():
    """The plug-in's function is upstream's source less one ``if`` that raises.

    ``without_cp_refusal`` raises when the installed torchtitan has no such
    block or another ``if`` on CP (the import then keeps upstream's function).
    Here the refusal is also found and cut by hand, and the two trees must be
    equal.
    """
    source = textwrap.dedent(
        inspect.getsource(upstream_parallelize.parallelize_muse_glimmer)
    )
    by_hand = ast.parse(source)
    parent, refusal = _upstream_refusal(by_hand)
    assert "context parallel is not supported" in ast.unparse(refusal)
    parent.body.remove(refusal)
    rebuilt = plugin_parallelize.DropCpRefusal().visit(ast.parse(source))
    assert ast.dump(rebuilt) == ast.dump(by_hand)


def _raising_frame(function) -> tuple:
    """Where ``function`` raises for an spmd backend it does not take (its first
    statement): file, line, function and source line of the innermost frame."""
    with pytest.raises(NotImplementedError) as raised:
        function(
            None,
            parallel_dims=None,
            training=None,
            parallelism=types.SimpleNamespace(spmd_backend="not_a_backend"),
            compile_config=None,
            ac_config=None,
            dump_folder="",
        )
    frame = traceback.extract_tb(raised.value.__traceback__)[-1]
    return frame.filename, frame.lineno, frame.name, frame.line


def test_a_raise_in_the_rebuilt_function_names_upstreams_line():
    """Tracebacks and breakpoints point into upstream's file at upstream's lines:
    every line the rebuilt code runs is the upstream line it came from."""
    upstream = upstream_parallelize.parallelize_muse_glimmer
    rebuilt = plugin_parallelize.parallelize_muse_glimmer
    assert _raising_frame(rebuilt) == _raising_frame(upstream)
    filename, _, _, line = _raising_frame(rebuilt)
    assert (filename, line) == (
        inspect.getsourcefile(upstream),
        "raise NotImplementedError(",
    )
    assert rebuilt.__code__.co_firstlineno == upstream.__code__.co_firstlineno

    _, refusal = _upstream_refusal(ast.parse(Path(filename).read_text()))
    refusal_lines = set(range(refusal.lineno, refusal.end_lineno + 1))

    def lines(code) -> set[int]:
        # The closure's prologue (COPY_FREE_VARS) has no line.
        return {line for *_, line in code.co_lines()} - {None}

    assert lines(rebuilt.__code__) == lines(upstream.__code__) - refusal_lines


def test_only_apply_compile_is_bound_and_upstreams_module_is_untouched():
    """The rebuilt function's one closure variable is the plug-in's
    ``apply_compile``; upstream's module keeps its own names, its function
    calling torchtitan's ``apply_compile``."""
    before = dict(vars(upstream_parallelize))
    rebuilt = plugin_parallelize.without_cp_refusal(
        upstream_parallelize.parallelize_muse_glimmer
    )
    assert vars(upstream_parallelize) == before
    assert upstream_parallelize.apply_compile is upstream_compile.apply_compile
    closure = [cell.cell_contents for cell in rebuilt.__closure__ or ()]
    assert dict(zip(rebuilt.__code__.co_freevars, closure, strict=True)) == {
        "apply_compile": plugin_parallelize.apply_compile
    }


def test_the_rebuilt_function_reads_upstreams_module_at_call_time(monkeypatch):
    """A later patch of upstream's module reaches the rebuilt function."""

    class Patched(Exception):
        pass

    def validate_config(parallel_dims, model):
        raise Patched

    monkeypatch.setattr(upstream_parallelize, "validate_config", validate_config)
    with pytest.raises(Patched):
        plugin_parallelize.parallelize_muse_glimmer(
            types.SimpleNamespace(vision_encoder=None),
            parallel_dims=types.SimpleNamespace(seq_len_divisor=1),
            training=types.SimpleNamespace(seq_len=8),
            parallelism=types.SimpleNamespace(spmd_backend="spmd_types"),
            compile_config=None,
            ac_config=None,
            dump_folder="",
        )


def test_the_rebuilt_function_parallelizes_with_the_plugins_apply_compile():
    """Rank 0 of the CP2 multimodal debug job with ``--compile.enable``, on a fake
    world of 2 ranks (meta device): upstream's function refuses CP and its
    ``apply_compile`` raises on the vision adapter. Here every decoder and vision
    block is compiled, the adapter left eager, and FSDP shards every parameter
    over dp_shard x cp."""
    job = train_config("cp2.toml", "--compile.enable")
    assert job.model_spec.parallelize_fn is plugin_parallelize.parallelize_muse_glimmer
    with simulated_rank(job, world_size=2) as rank:
        (model,) = rank.model_parts
        fsdp_mesh, _ = resolve_fsdp_mesh(rank.parallel_dims)  # upstream's
        fsdp_ranks = tuple(fsdp_mesh.mesh.flatten().tolist())
        cp_ranks = tuple(rank.parallel_dims.get_mesh("cp").mesh.flatten().tolist())
    assert fsdp_ranks == cp_ranks == (0, 1)  # dp_shard 1 x cp 2
    stacks = {
        "layers": model.layers,
        "vision_encoder.layers": model.vision_encoder.layers,
    }
    blocks = {
        f"{prefix}.{name}"
        for prefix, stack in stacks.items()
        for name in dict(stack.named_children())
    }
    compiled = {
        name
        for name, module in model.named_modules()
        if module._compiled_call_impl is not None
    }
    assert compiled == blocks
    units = {
        name for name, module in model.named_modules() if isinstance(module, FSDPModule)
    }
    assert {
        "vision_encoder",
        "vision_adapter",
        *(f"layers.{n}" for n in dict(model.layers.named_children())),
    } <= units
    placements = {
        (tuple(p.device_mesh.mesh.flatten().tolist()), p.placements)
        for p in model.parameters()
        if isinstance(p, DTensor)
    }
    assert placements == {(fsdp_ranks, (Shard(0),))}
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_without_cp_refusal_refuses_a_function_it_cannot_cut():
    """Not blind: a function with a second CP branch, or none, is refused."""

    def parallelize(parallel_dims):
        if parallel_dims.cp_enabled:
            raise NotImplementedError("no CP")
        if parallel_dims.cp_enabled:
            print("CP")
        return parallel_dims

    with pytest.raises(RuntimeError, match="found 1 .and 1 other"):
        plugin_parallelize.without_cp_refusal(parallelize)

    def without(parallel_dims):
        return parallel_dims

    with pytest.raises(RuntimeError, match="found 0"):
        plugin_parallelize.without_cp_refusal(without)
    rebuilt = plugin_parallelize.without_cp_refusal(_only_refusal)
    cp = types.SimpleNamespace(cp_enabled=True)
    assert rebuilt(cp) is cp  # _only_refusal raises for CP; the rebuilt one not


def _only_refusal(parallel_dims):
    if parallel_dims.cp_enabled:
        raise NotImplementedError("no CP")
    return parallel_dims


def _changed_upstream(model, **kwargs):
    """A torchtitan whose parallelize_muse_glimmer has no CP refusal to cut."""
    return model


def test_a_changed_upstream_imports_and_refuses_only_multimodal_cp(monkeypatch):
    """A torchtitan whose function cannot be rebuilt: the plug-in still imports
    and uses upstream's function unchanged; a multimodal CP job alone is refused,
    by its config, so on every rank alike before any collective."""
    monkeypatch.setattr(
        upstream_parallelize, "parallelize_muse_glimmer", _changed_upstream
    )
    spec = importlib.util.spec_from_file_location(
        "changed_upstream_parallelize", plugin_parallelize.__file__
    )
    changed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(changed)  # a fresh import, beside the real module
    assert changed.parallelize_muse_glimmer is _changed_upstream
    assert changed.REBUILD_FAILURE == (
        "RuntimeError: expected one `if parallel_dims.cp_enabled: raise` in "
        "torchtitan's _changed_upstream, found 0 (and 0 other "
        "`if parallel_dims.cp_enabled`): torchtitan changed; see UPSTREAM.md"
    )

    monkeypatch.setattr(plugin_parallelize, "REBUILD_FAILURE", changed.REBUILD_FAILURE)
    with pytest.raises(ValueError) as error:
        check_job_config(train_config("cp2.toml"), world_size=2)
    assert str(error.value) == (
        "parallelism.context_parallel_degree=2 needs torchtitan's "
        "parallelize_muse_glimmer rebuilt without its CP refusal, which failed on "
        f"the installed torchtitan {importlib.metadata.version('torchtitan')} "
        f"({changed.REBUILD_FAILURE}). Run with context_parallel_degree=1 "
        "(upstream's function, unchanged), or re-check torchtitan's new "
        "parallelize_muse_glimmer against the plug-in (UPSTREAM.md, the "
        "parallelize.py row) and update torchtitan_ext/muse_glimmer/parallelize.py "
        "and tests/unit/test_upstream_guards.py."
    )
    check_job_config(train_config("fsdp2.toml"), world_size=2)  # no CP
    text_only = train_config("cp2.toml")
    text_only.model_spec.model.vision_encoder = None  # upstream allows its CP
    check_job_config(text_only, world_size=2)


def _diff(expected: str, got: str) -> list[str]:
    return list(
        difflib.unified_diff(
            expected.splitlines(), got.splitlines(), "upstream", "plug-in", lineterm=""
        )
    )


# torchtitan 0.3.0's resampler builds its grid in this one statement; PR #4244
# replaces it with the backport's two (ij meshgrid, then (x, y) pairs).
_RESAMPLER_030 = ast.unparse(
    ast.parse(
        'pos_xy = torch.stack(torch.meshgrid(ys, xs, indexing="xy"), dim=-1)'
        ".reshape(-1, 2)[None, None]"
    )
)
_RESAMPLER_4244 = [
    ast.unparse(ast.parse(statement))
    for statement in (
        'yy, xx = torch.meshgrid(ys, xs, indexing="ij")',
        "pos_xy = torch.stack((xx, yy), dim=-1).reshape(-1, 2)[None, None]",
    )
]


def _body(function) -> list[str]:
    """A function's statements without its docstring, one string each."""
    node = ast.parse(inspect.getsource(function).strip()).body[0]
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    return [ast.unparse(statement) for statement in body]


def test_vision_resampler_is_the_030_one_with_4244_backported():
    """Upstream's ``_vision_pos_embed`` is 0.3.0's; ours differs by #4244 alone.

    Fails when the installed torchtitan's resampler changes: once a release
    carries #4244, drop ``torchtitan_ext/muse_glimmer/vision_encoder.py`` (and
    ``tests/upstream_with_4244.py``); any other change must be merged by hand.
    """
    upstream = _body(upstream_vision_encoder._vision_pos_embed)
    assert _RESAMPLER_030 in upstream, (
        "torchtitan's _vision_pos_embed no longer builds its grid as 0.3.0 did; "
        "if it carries PR #4244, drop the plug-in's backport:\n" + "\n".join(upstream)
    )
    at = upstream.index(_RESAMPLER_030)
    patched = [*upstream[:at], *_RESAMPLER_4244, *upstream[at + 1 :]]
    assert _body(plugin_vision_encoder.vision_pos_embed) == patched


def test_encoder_override_is_upstreams_call_to_the_backport():
    """The encoder's ``_get_pos_emb`` is upstream's, calling the backport instead."""
    upstream = _body(upstream_vision_encoder.MuseGlimmerVisionEncoder._get_pos_emb)
    ours = _body(plugin_vision_encoder.MuseGlimmerVisionEncoder._get_pos_emb)
    assert ours == [
        statement.replace("_vision_pos_embed(", "vision_pos_embed(")
        for statement in upstream
    ]


def test_torchtitan_apply_compile_still_fails_on_the_vision_adapter():
    """0.3.0's ``apply_compile`` raises on a module without ``layers``.

    The plug-in's ``parallelize.apply_compile`` leaves such a module eager, as
    torchtitan PR #4806 does; once the installed torchtitan no longer raises,
    drop the wrapper.
    """
    import torch
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import compile as upstream_compile

    adapter = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with (
        torch._dynamo.config.patch(
            capture_scalar_outputs=False,
            skip_fwd_side_effects_in_bwd_under_checkpoint=False,
        ),
        pytest.raises(AttributeError, match="layers"),
    ):
        upstream_compile.apply_compile(
            adapter,
            compile_config=CompileConfig(enable=True),
            parallel_dims=types.SimpleNamespace(tp_enabled=False),
        )
    plugin_parallelize.apply_compile(
        adapter,
        compile_config=CompileConfig(enable=True),
        parallel_dims=types.SimpleNamespace(tp_enabled=False),
    )


def test_trainer_module_uses_time_as_cpu_backend_replaces_it():
    """``cpu_backend`` gives torchtitan/trainer.py a ``time`` with perf_counter and
    a no-op sleep: upstream must use nothing else, and sleep once, in ``train``."""
    import importlib.util

    path = importlib.util.find_spec("torchtitan.trainer").origin
    tree = ast.parse(open(path).read())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "time"
    }
    assert used == {"perf_counter", "sleep"}, used
    trainer = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "Trainer"
    )
    sleeps = [
        (method.name, ast.unparse(node))
        for method in trainer.body
        if isinstance(method, ast.FunctionDef)
        for node in ast.walk(method)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "time.sleep"
    ]
    assert sleeps == [("train", "time.sleep(2)")], sleeps


def test_the_planner_trackers_private_torch_names_hold():
    """``tools/estimate/tracker.py`` extends torch's memory trackers through names
    torch keeps private (no public API files allocations by region, or tells
    DTensor's shape propagation from an allocation): a torch that renames or
    reshapes one fails here, by name, instead of inside the planner."""
    import torch
    from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    assert mem_tracker._TOTAL_KEY == "Total"
    assert set(mem_tracker._UpdateType.__members__) == {"ADD", "DEL", "REF", "SIZE"}
    assert list(inspect.signature(mem_tracker.MemTracker._update_snap).parameters) == [
        "self",
        "u_type",
        "winfo",
        "old_mem_consumed",
        "old_reftype",
    ]
    tracker = mem_tracker.MemTracker()
    assert hasattr(tracker._ref_class, "ACT")
    assert isinstance(tracker._mod_tracker.parents, set)
    assert "PRE_FW" in fsdp2_mem_tracker._FSDPState.__members__
    assert "_fsdp_state" in inspect.getsource(fsdp2_mem_tracker.FSDPMemTracker)
    assert list(
        inspect.signature(
            ShardingPropagator._propagate_tensor_meta_non_cached
        ).parameters
    ) == ["self", "op_schema"]
    assert torch._C._current_graph_task_id() == -1  # outside the autograd engine


def test_the_planners_private_schedule_names_hold():
    """``planner.microbatches_in_flight`` reads a schedule's microbatch and stage
    counts, which torch keeps private (no public accessor): a torch that renames
    either fails here, by name, instead of inside the planner."""
    from torch.distributed.pipelining import schedules

    assert issubclass(schedules.Schedule1F1B, schedules.PipelineScheduleSingle)
    assert issubclass(schedules.ScheduleGPipe, schedules.PipelineScheduleSingle)
    init = inspect.getsource(schedules._PipelineSchedule.__init__)
    single_init = inspect.getsource(schedules.PipelineScheduleSingle.__init__)
    assert "self._n_microbatches = n_microbatches" in init
    assert "self._num_stages = stage.num_stages" in single_init


# torchtitan 0.3.0's packer methods the plug-in's ``_ImageCappedPacker`` replaces
# (``_pack_buffered_samples``: its loop, plus an image bound) or extends.
_PACKER_030 = {
    "_pack_buffered_samples": (
        "hf_datasets/multimodal/utils/packing.py",
        45,
        "dc306fedf43d2f2ed829ce31a7b2b4e2f73756cf586f7666d2ae3f35ab99aff1",
    ),
    "_merge_samples": (
        "hf_datasets/multimodal/utils/packing.py",
        81,
        "5c3ac43bbd63b2a8f65603701d7fbd93161377c1834791103300725c60b5ee37",
    ),
}


def test_upstream_packer_is_the_pinned_030_source():
    from torchtitan.hf_datasets.multimodal.utils.packing import MMSamplePacker

    for name, want in _PACKER_030.items():
        pin = _source_pin(getattr(MMSamplePacker, name))
        assert pin == want, (
            f"torchtitan's MMSamplePacker.{name} (file, first line, sha256) is {pin}, "
            f"not 0.3.0's {want}. torchtitan_ext/muse_glimmer/data.py's "
            "_ImageCappedPacker is its scan-and-pick loop plus an image bound and "
            "merges rows with it: re-check the packing rule (and whether upstream "
            "now bounds images itself: then drop the subclass), the merged keys, "
            "then re-pin _PACKER_030."
        )


def test_the_image_capped_packer_packs_as_upstream_without_the_bound():
    """With a bound no row reaches, the plug-in's packer picks upstream's rows."""
    import torch
    from torchtitan.hf_datasets.multimodal.utils.packing import MMSamplePacker

    from torchtitan_ext.muse_glimmer.data import _ImageCappedPacker

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (60,), generator=generator).tolist()
    upstream = MMSamplePacker(max_seq_length=64, buffer_size=8, batch_size=2)
    ours = _ImageCappedPacker(upstream, max_images=10**6, temporal=2)
    for packer in (upstream, ours):
        for index, length in enumerate(lengths):
            packer.add_sample(
                {
                    "input_ids": torch.full((length,), index),
                    "labels": torch.zeros(length),
                    "positions": torch.arange(length),
                    "pixel_values": [torch.zeros(1, 2, 2, 3)] * (index % 3),
                }
            )
        packer.flush()
    rows = [
        [r["input_ids"].tolist() for r in p.packed_samples] for p in (upstream, ours)
    ]
    assert len(rows[0]) > 10 and rows[0] == rows[1]
