"""Where the plug-in replaces an upstream function whole, notice upstream changes."""

import ast
import difflib
import inspect

from torchtitan.models.muse_glimmer import parallelize as upstream_parallelize

from torchtitan_ext.muse_glimmer import parallelize as plugin_parallelize

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
