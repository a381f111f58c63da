"""Apply TP, AC, compile and FSDP to muse_glimmer, context parallelism included.

torchtitan 0.3.0's ``parallelize_muse_glimmer`` refuses CP for the vision
encoder in its first lines, before any hook could run. Rather than keep a copy
of its hundred lines, ``parallelize_muse_glimmer`` here is that function
recompiled from the installed source without the one ``if
parallel_dims.cp_enabled: raise`` block (``without_cp_refusal``): every other
line stays upstream's, at upstream's line numbers (tracebacks and breakpoints
land in upstream's file), reading upstream's module globals at each call.
``tests/unit/test_upstream_guards.py`` pins the function's whole source. Under
CP, FSDP's mesh is (dp_shard, cp): the vision parameters are ``R`` on cp
(``sharding.py``), so their gradients are summed over the CP ranks, each of
which used only its own tokens' feature rows.

A torchtitan whose function cannot be rebuilt (the refusal gone, or not alone)
still imports: its function is used unchanged, and ``check_cp_parallelize``
refuses a multimodal CP job at start-up (``config_checks.check_job_config``).

``apply_compile`` (the rebuilt function's) is torchtitan's, except that a
module without a ``layers`` block stack (the vision adapter, a two-layer MLP)
is left eager: 0.3.0's function raises ``AttributeError`` on it, so
``--compile.enable`` failed for every multimodal muse_glimmer job, upstream's
included. torchtitan PR #4806 (merged after 0.3.0) stops compiling the adapter.
"""

import ast
import importlib.metadata
import inspect
import textwrap
import types

from torchtitan.config import CompileConfig
from torchtitan.distributed.compile import apply_compile as _upstream_apply_compile
from torchtitan.models.muse_glimmer import parallelize as _upstream
from torchtitan.tools.logging import logger

__all__ = [
    "CP_REFUSAL",
    "REBUILD_FAILURE",
    "apply_compile",
    "check_cp_parallelize",
    "parallelize_muse_glimmer",
    "without_cp_refusal",
]

CP_REFUSAL = "parallel_dims.cp_enabled"
# The name the rebuilt function reads as a closure variable instead of a global.
_REPLACED = "apply_compile"


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
    """``function`` recompiled without its CP refusal, ``apply_compile`` this module's.

    The definition keeps its lines in its own file, and is compiled inside
    ``def _bind(apply_compile)``: that one name becomes a closure variable,
    every other global is looked up in ``function``'s module at each call (a
    later patch of it reaches the rebuilt function), and the module itself is
    left as it was.
    """
    lines, first_line = inspect.getsourcelines(function)
    definition = ast.parse(textwrap.dedent("".join(lines))).body[0]
    ast.increment_lineno(definition, first_line - 1)
    drop = DropCpRefusal()
    definition = drop.visit(definition)
    if (drop.dropped, drop.kept) != (1, 0):
        raise RuntimeError(
            f"expected one `if {CP_REFUSAL}: raise` in torchtitan's "
            f"{function.__name__}, found {drop.dropped} (and {drop.kept} other "
            f"`if {CP_REFUSAL}`): torchtitan changed; see UPSTREAM.md"
        )
    bind = ast.parse(f"def _bind({_REPLACED}):\n    return {function.__name__}")
    ast.increment_lineno(bind, first_line - 1)
    bind.body[0].body.insert(0, definition)
    code = compile(bind, inspect.getsourcefile(function), "exec")
    (bind_code,) = (c for c in code.co_consts if isinstance(c, types.CodeType))
    rebuilt = types.FunctionType(bind_code, function.__globals__)(apply_compile)
    rebuilt.__module__ = __name__
    rebuilt.__qualname__ = function.__qualname__
    rebuilt.__doc__ = f"torchtitan's {function.__name__}, CP allowed."
    return rebuilt


def _rebuilt_or_upstreams(function):
    """``function`` rebuilt and None, or ``function`` itself and why not."""
    try:
        return without_cp_refusal(function), None
    except (OSError, TypeError, RuntimeError) as error:
        failure = f"{type(error).__name__}: {error}"
    logger.warning(
        f"torchtitan's {function.__name__} could not be rebuilt without its CP "
        f"refusal ({failure}); it is used unchanged (its apply_compile too: "
        "--compile.enable fails on the vision adapter, as upstream's jobs do) and "
        "multimodal jobs with context_parallel_degree > 1 are refused at start-up."
    )
    return function, failure


parallelize_muse_glimmer, REBUILD_FAILURE = _rebuilt_or_upstreams(
    _upstream.parallelize_muse_glimmer
)


def _torchtitan_version() -> str:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:  # a source checkout
        return "(version unknown)"


def check_cp_parallelize(cp_degree: int) -> None:
    """A multimodal CP job needs the rebuilt function; without it, refuse the job
    from its config alone, so every rank raises the same error before any collective."""
    if cp_degree <= 1 or REBUILD_FAILURE is None:
        return
    raise ValueError(
        f"parallelism.context_parallel_degree={cp_degree} needs torchtitan's "
        "parallelize_muse_glimmer rebuilt without its CP refusal, which failed on "
        f"the installed torchtitan {_torchtitan_version()} "
        f"({REBUILD_FAILURE}). Run with context_parallel_degree=1 (upstream's "
        "function, unchanged), or re-check torchtitan's new parallelize_muse_glimmer "
        "against the plug-in (UPSTREAM.md, the parallelize.py row) and update "
        "torchtitan_ext/muse_glimmer/parallelize.py and "
        "tests/unit/test_upstream_guards.py."
    )
