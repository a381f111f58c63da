"""TOML config files for ``python -m torchtitan_ext.train``.

A file is a saved command line: its ``[job]`` table names the registry entry
(``module`` and ``config``) and every other key becomes one ``--section.key``
override. Keys and value types are checked against the loaded config dataclass
first, so a typo fails with one message naming the file and the key, before any
process group exists, instead of deep inside tyro or the Trainer.

torchtitan is imported only inside functions, so that importing this module
does not defeat ``torchtitan_ext.cpu_backend.apply()``.
"""

import dataclasses
import difflib
import logging
import math
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["CONFIG_FILE_FLAG", "ConfigFileError", "job_ranks", "load_job", "merge_args"]

CONFIG_FILE_FLAG = "--job.config_file"
_FLAG_SPELLINGS = (CONFIG_FILE_FLAG, "--job.config-file")
_JOB_KEYS = ("module", "config")


class ConfigFileError(ValueError):
    """A config file that cannot be turned into torchtitan overrides."""


class _Mismatch(Exception):
    """A value that does not fit a type; ``args[0]``, if any, says why."""


@dataclasses.dataclass
class _Overrides:
    """Flags from a file, with subcommand flags kept apart: tyro reads those
    only after the subcommand's name, which must follow all other flags."""

    flags: list[str] = dataclasses.field(default_factory=list)
    subcommands: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def merge_args(args: list[str]) -> list[str]:
    """Expand ``--job.config_file PATH`` in ``args`` into torchtitan arguments.

    Returns ``--module M --config C <file overrides> <args>``: torchtitan and
    tyro both let the last occurrence of a flag win, so the command line beats
    the file. Without ``--job.config_file``, ``args`` is returned unchanged.
    """
    path, cli = _pop_config_file(args)
    if path is None:
        return list(args)
    table = _load_toml(path)
    head = _job_args(path, table.pop("job", {}), cli)

    from torchtitan.config import ConfigManager

    # torchtitan loads (and logs) the config again itself; keep this load quiet
    # so that a bad file reports just one line.
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        config, _ = ConfigManager()._load_config(head + cli)
    except (ImportError, ValueError) as e:
        raise ConfigFileError(f"{path}: cannot load the job's config: {e}") from e
    finally:
        logging.disable(previous)
    overrides = _Overrides()
    _walk(path, table, config, "", overrides)
    return head + overrides.flags + _merge_subcommands(overrides.subcommands, cli)


def load_job(args: list[str]):
    """A job's ``Trainer.Config`` from command-line arguments, as training does."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(merge_args(args))


def job_ranks(config, *, data_parallel_shard: int | None = None) -> int:
    """The ranks a job runs on: the product of its parallel degrees.

    An inferred ``data_parallel_shard_degree`` (-1) counts as
    ``data_parallel_shard``; with none given, as 1 (the smallest world).
    """
    parallelism = config.parallelism
    shard = parallelism.data_parallel_shard_degree
    if shard < 1:
        shard = 1 if data_parallel_shard is None else data_parallel_shard
    return shard * math.prod(
        (
            parallelism.data_parallel_replicate_degree,
            parallelism.context_parallel_degree,
            parallelism.tensor_parallel_degree,
            parallelism.pipeline_parallel_degree,
        )
    )


def _pop_config_file(args: list[str]) -> tuple[str | None, list[str]]:
    path, rest = None, []
    it = iter(args)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name not in _FLAG_SPELLINGS:
            rest.append(arg)
        elif eq:
            path = value
        else:
            path = next(it, None)
            if path is None:
                raise ConfigFileError(f"{CONFIG_FILE_FLAG} requires a path")
    return path, rest


def _load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read config file: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"{path}: invalid TOML: {e}") from None


def _job_args(path: str, job: Any, cli: list[str]) -> list[str]:
    """``--module``/``--config`` from ``[job]``, placed first so the CLI wins."""
    if not isinstance(job, dict):
        raise ConfigFileError(f"{path}: job: expected a table [job], got {_show(job)}")
    for key, value in job.items():
        if key not in _JOB_KEYS:
            raise _unknown(path, key, "job.", _JOB_KEYS, value)
        if not isinstance(value, str):
            raise ConfigFileError(
                f"{path}: job.{key}: expected str, got {_show(value)}"
            )
    head = []
    for key in _JOB_KEYS:
        flag = f"--{key}"
        if key in job:
            head += [flag, job[key]]
        elif not any(a == flag or a.startswith(f"{flag}=") for a in cli):
            raise ConfigFileError(
                f"{path}: [job] has no '{key}'; set [job] module (e.g. "
                '"muse_glimmer") and config (a config_registry function, e.g. '
                f'"muse_glimmer_debugmodel"), or pass {flag}'
            )
    return head


def _walk(path: str, table: dict, node: Any, prefix: str, out: _Overrides) -> None:
    """Check ``table`` against config ``node`` and append its overrides to ``out``."""
    children = _children(node)
    for key, value in table.items():
        dotted = prefix + key
        if key not in children:
            raise _unknown(path, key, prefix, children, value)
        tp, default = children[key]
        if not _is_section(default):
            out.flags += _leaf(path, dotted, tp, value)
            continue
        if not isinstance(value, dict):
            raise ConfigFileError(
                f"{path}: {dotted}: expected a table [{dotted}], got {_show(value)}"
            )
        selector = _subcommand(path, dotted, tp, default)
        if selector is None:
            _walk(path, value, default, dotted + ".", out)
        else:
            sub = _Overrides()
            _walk(path, value, default, dotted + ".", sub)
            out.subcommands[selector] = sub.flags
            out.subcommands.update(sub.subcommands)


def _children(node: Any) -> dict[str, tuple[Any, Any]]:
    """``key -> (type, default)`` for what tyro exposes under ``node``.

    Types come from the actual default instance, as in tyro: a field declared as
    ``BaseDataLoader.Config`` may hold an ``MMDataLoader.Config``.
    """
    if _is_config(node):
        hints = typing.get_type_hints(type(node), include_extras=True)
        children = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            empty_dict = isinstance(value, dict) and not value  # tyro shows no keys
            if f.init and not _suppressed(hints[f.name]) and not empty_dict:
                children[f.name] = (hints[f.name], value)
        return children
    if isinstance(node, dict):  # tyro expands a dict default into its keys
        return {str(k): (_value_type(v), v) for k, v in node.items()}
    return {str(i): (type(v), v) for i, v in enumerate(node)}  # list of configs


def _suppressed(tp: Any) -> bool:
    import tyro

    markers = getattr(tp, "__metadata__", ())
    return any(m is tyro.conf.Suppress or m is tyro.conf.Fixed for m in markers)


def _is_section(value: Any) -> bool:
    """Whether tyro expands ``value`` into flags of its own (``--a.b.c``)."""
    if isinstance(value, dict | list | tuple):
        return bool(value) and (isinstance(value, dict) or all(map(_is_config, value)))
    return _is_config(value)


def _is_config(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _value_type(value: Any) -> Any:
    """The type tyro infers for a value of a ``dict[str, Any]`` default."""
    if isinstance(value, list | tuple) and value:
        elem = type(value[0])
        return list[elem] if isinstance(value, list) else tuple[elem, ...]
    return type(value)


def _subcommand(path: str, dotted: str, tp: Any, default: Any) -> str | None:
    """The tyro subcommand (``field:name``) selecting ``default``, if any.

    tyro turns a union of configs (e.g. ``activation_checkpoint``) into
    subcommands; the file's table then configures the default's choice.
    """
    from tyro.conf._confstruct import _SubcommandConfig

    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return None
    for member in typing.get_args(tp):
        metas = getattr(member, "__metadata__", ())
        if typing.get_origin(member) is Annotated:
            member = typing.get_args(member)[0]
        if member is not type(default):
            continue
        for meta in metas:
            if isinstance(meta, _SubcommandConfig) and meta.name:
                return f"{dotted}:{meta.name}" if meta.prefix_name else meta.name
    raise ConfigFileError(
        f"{path}: {dotted}: this section is a tyro subcommand without a fixed "
        "name; set it on the command line"
    )


def _leaf(path: str, dotted: str, tp: Any, value: Any) -> list[str]:
    """The override for one value: ``--k v``, ``--k v1 v2`` or a bool flag."""
    try:
        if _strip_optional(tp) is bool:  # tyro renders bools as flag pairs
            if not isinstance(value, bool):
                raise _Mismatch()
            head, dot, name = dotted.rpartition(".")
            return [f"--{dotted}" if value else f"--{head}{dot}no-{name}"]
        tokens = _tokens(value, tp)
    except _Mismatch as e:
        why = f" ({e.args[0]})" if e.args else ""
        raise ConfigFileError(
            f"{path}: {dotted}: expected {_type_name(tp)}, got {_show(value)}{why}"
        ) from None
    if len(tokens) == 1 and tokens[0].startswith("-"):
        return [f"--{dotted}={tokens[0]}"]  # "--k -x" would read -x as a flag
    return [f"--{dotted}", *tokens]


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return tp


def _tokens(value: Any, tp: Any) -> list[str]:
    """The CLI tokens tyro parses back into ``value`` for type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _tokens(value, args[0])
    if origin in (Union, types.UnionType):  # TOML has no null: skip None
        for member in args:
            if member is not type(None):
                try:
                    return _tokens(value, member)
                except _Mismatch:
                    pass
        raise _Mismatch()
    if origin is Literal:
        if any(value == c and type(value) is type(c) for c in args):
            return [str(value)]
        raise _Mismatch()
    if tp == list[str]:  # ConfigManager registers a comma-separated rule for it
        if not (isinstance(value, list) and value):
            raise _Mismatch("a non-empty list; an empty one cannot be written as A,B")
        if not all(isinstance(v, str) and "," not in v for v in value):
            raise _Mismatch("items are joined with ',' so may not contain one")
        return [",".join(value)]
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list):
            raise _Mismatch()
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _Mismatch(f"{len(args)} items")
            elem_types = args
        else:
            elem_types = (args[0] if args else Any,) * len(value)
        tokens = [_tokens(v, t) for v, t in zip(value, elem_types, strict=True)]
        if any(len(t) != 1 for t in tokens):
            raise _Mismatch("nested lists are not supported")
        return [t for (t,) in tokens]
    if _is_scalar(value, tp):
        return [str(value)]
    raise _Mismatch()


def _is_scalar(value: Any, tp: Any) -> bool:
    if tp is Any:
        return isinstance(value, bool | int | float | str)
    if isinstance(value, bool):  # bool is an int subclass
        return tp is bool
    return (
        (tp is int and isinstance(value, int))
        or (tp is float and isinstance(value, int | float))
        or (tp is str and isinstance(value, str))
    )


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if isinstance(tp, type) and not args:
        return tp.__qualname__
    return str(tp).replace("typing.", "")


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value!r}"


def _unknown(
    path: str, key: str, prefix: str, valid: Iterable[str], value: Any
) -> ConfigFileError:
    valid = sorted(valid)
    dotted = prefix + key
    what = f"section [{dotted}]" if isinstance(value, dict) else f"key '{dotted}'"
    where = f"[{prefix[:-1]}]" if prefix else "the top level"
    close = difflib.get_close_matches(key, valid, n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    return ConfigFileError(
        f"{path}: unknown {what}{hint}; valid keys in {where}: {', '.join(valid)}"
    )


def _merge_subcommands(groups: dict[str, list[str]], cli: list[str]) -> list[str]:
    """``cli`` with the file's subcommand flags placed where tyro reads them.

    If the command line selects the same subcommand, the file's flags go right
    after its name (so the CLI's own flags still win); if it selects another
    one, the file's flags do not apply to it and are dropped. Subcommands the
    command line does not select go last.
    """
    merged = []
    for arg in cli:
        merged.append(arg)
        if arg.startswith("-") or ":" not in arg:
            continue
        for selector in list(groups):
            if _norm(arg).split(":")[0] == _norm(selector).split(":")[0]:
                flags = groups.pop(selector)
                if _norm(arg) == _norm(selector):
                    merged += flags
    return merged + [t for sel, flags in groups.items() for t in (sel, *flags)]


def _norm(token: str) -> str:
    return token.replace("-", "_")
