"""Where the plug-in replaces an upstream function whole, notice upstream changes."""

import ast
import difflib
import inspect
import types

import pytest
from torchtitan.models.muse_glimmer import parallelize as upstream_parallelize
from torchtitan.models.muse_glimmer import vision_encoder as upstream_vision_encoder

from torchtitan_ext.muse_glimmer import parallelize as plugin_parallelize
from torchtitan_ext.muse_glimmer import vision_encoder as plugin_vision_encoder

_FUNCTION = "parallelize_muse_glimmer"
_CP_REFUSAL = "parallel_dims.cp_enabled"


def _function_ast(source: str) -> ast.FunctionDef:
    """The function's syntax tree without its docstring: comments do not count."""
    tree = ast.parse(source)
    function = next(
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == _FUNCTION
    )
    if ast.get_docstring(function) is not None:
        function.body = function.body[1:]
    return function


class _DropCpRefusal(ast.NodeTransformer):
    """Removes every ``if parallel_dims.cp_enabled: ...`` block, counting them."""

    def __init__(self) -> None:
        self.dropped = 0

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        if ast.unparse(node.test) == _CP_REFUSAL:
            assert all(isinstance(stmt, ast.Raise) for stmt in node.body), ast.unparse(
                node
            )
            self.dropped += 1
            return None
        return node


def test_parallelize_is_upstreams_minus_its_cp_refusal():
    """Upstream's function minus its CP ``raise`` is ours, statement for statement.

    Fails when torchtitan's ``parallelize_muse_glimmer`` changes in any other
    way (an upgrade must be merged by hand) or no longer refuses CP (then the
    replacement can go and upstream's function can be used as it is).
    """
    drop = _DropCpRefusal()
    upstream = drop.visit(_function_ast(inspect.getsource(upstream_parallelize)))
    assert drop.dropped == 1, (
        f"expected one `if {_CP_REFUSAL}: raise ...` in torchtitan's {_FUNCTION}, "
        f"found {drop.dropped}"
    )
    ours = _function_ast(inspect.getsource(plugin_parallelize))
    assert ast.dump(ours) == ast.dump(upstream), (
        f"torchtitan's {_FUNCTION} changed; differences from "
        "torchtitan_ext/muse_glimmer/parallelize.py:\n"
        + "\n".join(_diff(ast.unparse(upstream), ast.unparse(ours)))
    )


def test_the_guard_sees_a_one_token_change():
    """Not blind: one changed argument, or the refusal kept, makes the trees differ."""
    ours = inspect.getsource(plugin_parallelize)
    planted = ours.replace(
        "pp_enabled=parallel_dims.pp_enabled,\n                dp_mesh_dims",
        "pp_enabled=False,\n                dp_mesh_dims",
    )
    assert planted != ours
    assert ast.dump(_function_ast(planted)) != ast.dump(_function_ast(ours))
    upstream = _function_ast(inspect.getsource(upstream_parallelize))
    assert ast.dump(upstream) != ast.dump(_function_ast(ours))


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
