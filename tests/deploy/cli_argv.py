"""Check a `kvwire ...` argv from a manifest against the real typer app.

The manifests and the CLI are written by different people at different times; this is
what keeps them from drifting apart: every sub-command and `--flag` a manifest passes
must exist, take a value if given one, accept that value where it is known before the
pod starts, appear once, and every required option must be given (by flag or env var).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import typer

# typer >= 0.16 vendors its own click (typer._click): test parameters by their
# `param_type_name`, not by isinstance against the click package.
Command = Any


@functools.lru_cache(maxsize=1)
def kvwire_group() -> Command:
    """The click group behind `kvwire` (`cli.main:app`, the console script's target)."""
    from kvwire.cli.main import app

    return typer.main.get_command(app)


def check_argv(argv: list[str], expand: Callable[[str], str | None], env: dict) -> list[str]:
    """Problems of one `kvwire SUBCOMMAND ...` argv; empty when the CLI accepts it.

    Args:
        argv: command + args, starting with "kvwire".
        expand: resolves $(VAR) references; returns None where the value is only known
            in the cluster (then the value's type is not checked).
        env: the container's environment names (for options given by env var).
    Returns:
        One human-readable line per problem.
    """
    if len(argv) < 2 or argv[1] not in kvwire_group().commands:
        return [f"{argv[:2]}: no such kvwire sub-command"]
    command = kvwire_group().commands[argv[1]]
    ctx = command.context_class(command, info_name=argv[1])
    options = {name: p for p in command.params if _is(p, "option") for name in p.opts + p.secondary_opts}
    problems, seen, positionals = [], set(), 0
    i = 2
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-"):
            positionals += 1
            continue
        name, has_value, value = token.partition("=")
        param = options.get(name)
        if param is None:
            problems.append(f"kvwire {argv[1]}: no such option {name}")
            if not has_value and i < len(argv) and not argv[i].startswith("-"):
                i += 1  # most likely its value, not a positional argument
            continue
        if param.name in seen:
            problems.append(f"kvwire {argv[1]}: {name} given twice (the last one silently wins)")
        seen.add(param.name)
        if param.is_flag:
            continue
        if not has_value:
            if i >= len(argv):
                problems.append(f"kvwire {argv[1]}: {name} has no value")
                break
            value, i = argv[i], i + 1
        problems += _check_value(ctx, param, name, value, expand)
    problems += _check_arguments_and_required(command, argv[1], positionals, seen, env)
    return problems


def _is(param: Any, kind: str) -> bool:
    return getattr(param, "param_type_name", None) == kind


def _check_value(ctx: Any, param: Any, name: str, value: str,
                 expand: Callable[[str], str | None]) -> list[str]:
    resolved = expand(value)
    if resolved is None:
        return []
    try:
        param.process_value(ctx, resolved)  # the conversion and range checks a real run does
    except Exception as exc:
        # click's BadParameter, from whichever click typer uses; anything else is a bug here.
        if not any(k.__name__ == "UsageError" for k in type(exc).__mro__):
            raise
        return [f"kvwire {ctx.info_name}: {name} {resolved!r} rejected: {getattr(exc, 'message', exc)}"]
    return []


def _check_arguments_and_required(command: Command, sub: str, positionals: int,
                                  seen: set[str], env: dict) -> list[str]:
    arguments = [p for p in command.params if _is(p, "argument")]
    problems = []
    if positionals > len(arguments):
        problems.append(f"kvwire {sub}: {positionals} positional arguments, takes {len(arguments)}")
    problems += [f"kvwire {sub}: missing required argument {p.name}"
                 for p in arguments[positionals:] if p.required]
    for param in command.params:
        if _is(param, "option") and param.required and param.name not in seen:
            envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
            if not any(e in env for e in envvars):
                problems.append(f"kvwire {sub}: required option {param.opts[0]} given neither as a flag "
                                f"nor by env var {envvars}")
    return problems
