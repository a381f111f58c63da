"""Apply TP, AC, compile and FSDP to muse_glimmer, context parallelism included.

torchtitan 0.3.0's ``parallelize_muse_glimmer`` refuses CP for the vision
encoder in its first lines, before any hook could run. Rather than keep a copy
of its hundred lines, ``parallelize_muse_glimmer`` here is that function
recompiled from the installed source without the one ``if
parallel_dims.cp_enabled: raise`` block (``without_cp_refusal``), so every
other line stays upstream's, whatever the installed version holds;
``tests/unit/test_upstream_guards.py`` fails when the refusal is gone or no
longer alone. Under CP, FSDP's mesh is (dp_shard, cp): the vision parameters
are ``R`` on cp (``sharding.py``), so their gradients are summed over the CP
ranks, each of which used only its own tokens' feature rows.

``apply_compile`` (the recompiled function's) is torchtitan's, except that a
module without a ``layers`` block stack (the vision adapter, a two-layer MLP)
is left eager: 0.3.0's function raises ``AttributeError`` on it, so
``--compile.enable`` failed for every multimodal muse_glimmer job, upstream's
included. torchtitan PR #4806 (merged after 0.3.0) stops compiling the adapter.
"""

import ast
import inspect
import textwrap

from torchtitan.config import CompileConfig
from torchtitan.distributed.compile import apply_compile as _upstream_apply_compile
from torchtitan.models.muse_glimmer import parallelize as _upstream
from torchtitan.tools.logging import logger

__all__ = ["CP_REFUSAL", "apply_compile", "parallelize_muse_glimmer"]

CP_REFUSAL = "parallel_dims.cp_enabled"


def apply_compile(model, *, compile_config: CompileConfig, parallel_dims) -> None:
    """torchtitan's per-block compile; a module without ``layers`` stays eager."""
    if not hasattr(model, "layers"):
        logger.info(f"{type(model).__name__} has no block stack: left uncompiled")
        return
    _upstream_apply_compile(
        model, compile_config=compile_config, parallel_dims=parallel_dims
    )


class DropCpRefusal(ast.NodeTransformer):
    """Removes every ``if parallel_dims.cp_enabled: raise ...`` block, counting
    them; an ``if`` on it that does more than raise is kept and counted apart."""

    def __init__(self) -> None:
        self.dropped = 0
        self.kept = 0

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        if ast.unparse(node.test) != CP_REFUSAL:
            return node
        if all(isinstance(statement, ast.Raise) for statement in node.body):
            self.dropped += 1
            return None
        self.kept += 1
        return node


def without_cp_refusal(function):
    """``function`` recompiled without its CP refusal, in its module's globals
    with ``apply_compile`` replaced by this module's."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    drop = DropCpRefusal()
    tree = ast.fix_missing_locations(drop.visit(tree))
    if (drop.dropped, drop.kept) != (1, 0):
        raise RuntimeError(
            f"expected one `if {CP_REFUSAL}: raise` in torchtitan's "
            f"{function.__name__}, found {drop.dropped} (and {drop.kept} other "
            f"`if {CP_REFUSAL}`): torchtitan changed; see UPSTREAM.md"
        )
    namespace = {**function.__globals__, "apply_compile": apply_compile}
    exec(compile(tree, inspect.getsourcefile(function), "exec"), namespace)
    rebuilt = namespace[function.__name__]
    rebuilt.__module__ = __name__
    rebuilt.__doc__ = "torchtitan's parallelize_muse_glimmer, CP allowed."
    return rebuilt


parallelize_muse_glimmer = without_cp_refusal(_upstream.parallelize_muse_glimmer)
