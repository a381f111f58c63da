"""Where the plug-in replaces an upstream function whole, notice upstream changes."""

import ast
import difflib
import inspect
import textwrap
import types

import pytest
from torchtitan.models.muse_glimmer import parallelize as upstream_parallelize
from torchtitan.models.muse_glimmer import vision_encoder as upstream_vision_encoder

from torchtitan_ext.muse_glimmer import parallelize as plugin_parallelize
from torchtitan_ext.muse_glimmer import vision_encoder as plugin_vision_encoder


def test_parallelize_is_upstreams_minus_its_one_cp_refusal():
    """The plug-in's function is upstream's source less one ``if`` that raises.

    ``without_cp_refusal`` raises at import when the installed torchtitan has
    no such block (then upstream's function can be used as it is) or another
    ``if`` on CP. Here the refusal is also found and cut by hand, and the two
    trees must be equal.
    """
    source = textwrap.dedent(
        inspect.getsource(upstream_parallelize.parallelize_muse_glimmer)
    )
    by_hand = ast.parse(source)
    found = [
        (node, statement)
        for node in ast.walk(by_hand)
        for statement in getattr(node, "body", [])
        if isinstance(statement, ast.If)
        and ast.unparse(statement.test) == plugin_parallelize.CP_REFUSAL
    ]
    assert len(found) == 1, found
    parent, refusal = found[0]
    assert "context parallel is not supported" in ast.unparse(refusal)
    parent.body.remove(refusal)
    rebuilt = plugin_parallelize.DropCpRefusal().visit(ast.parse(source))
    assert ast.dump(rebuilt) == ast.dump(by_hand)


def test_the_rebuilt_function_parallelizes_with_the_plugins_apply_compile():
    fn = plugin_parallelize.parallelize_muse_glimmer
    assert fn.__module__ == plugin_parallelize.__name__
    assert fn.__globals__["apply_compile"] is plugin_parallelize.apply_compile
    assert fn is not upstream_parallelize.parallelize_muse_glimmer


def test_a_second_cp_branch_upstream_stops_the_import():
    """Not blind: upstream with a second CP branch, or none, is refused."""

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
