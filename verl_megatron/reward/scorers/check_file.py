"""Check a user's scorer file in a throw-away interpreter: it imports and defines the function.

Run as ``python -c <this file's source> PATH NAME [CALL_ARGS_JSON]`` by
:func:`verl_megatron.reward.loading.check_reward_config`: importing a file executes its
top level, which may call ``sys.exit``, crash or hang, so the trainer does it in a child
process. Standard library only (the child starts in milliseconds). The last stdout line
that starts with ``MARKER`` carries the result as JSON: ``{"ok": true}`` or
``{"error": "<one line naming the file, the line and the function>"}``.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import sys
import traceback

MARKER = "verl-megatron-scorer-check: "


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _line_in(path: str, err: BaseException) -> str:
    """ ", line N" of the deepest frame of ``err`` that ran in ``path``, or ""."""
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == path]
    return f", line {lines[-1]}" if lines else ""


def check(path: str, name: str, call_args: list[str] | None = None) -> dict[str, object]:
    """Import ``path`` and look up ``name``; a dict as described in the module docstring.

    ``call_args``: the keyword arguments the reward manager will call the function with;
    a function whose signature cannot take them is an error."""
    where = f"custom_reward_function.path='{path}'"
    wanted = f"cannot load function '{name}' (custom_reward_function.name)"
    try:
        spec = importlib.util.spec_from_file_location("verl_megatron_scorer_check", path)
        if spec is None or spec.loader is None:
            return {"error": f"{where}: not a Python file; {wanted}"}
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    except SyntaxError as err:
        return {"error": f"{where}, line {err.lineno}: SyntaxError: {_one_line(err.msg)}; {wanted}"}
    except SystemExit as err:
        return {
            "error": f"{where}{_line_in(path, err)}: importing it called sys.exit({err.code!r}); {wanted}"
        }
    except BaseException as err:  # any failure of user code is reported, not raised
        message = _one_line(f"{type(err).__name__}: {err}")
        return {"error": f"{where}{_line_in(path, err)}: importing it raised {message}; {wanted}"}
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        close = difflib.get_close_matches(name, defined, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return {
            "error": f"custom_reward_function.name='{name}' is not defined in '{path}'; {hint}"
            f"(functions there: {', '.join(defined) or 'none'})"
        }
    if not callable(fn):
        return {
            "error": f"custom_reward_function.name='{name}' in '{path}' is a {type(fn).__name__}, not a function"
        }
    return _check_signature(fn, path, name, call_args or [])


def _check_signature(fn: object, path: str, name: str, call_args: list[str]) -> dict[str, object]:
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): found out at the first call
        return {"ok": True}
    try:
        signature.bind(**dict.fromkeys(call_args))
    except TypeError as err:
        return {
            "error": f"custom_reward_function.name='{name}' in '{path}': {name}{signature} cannot be called "
            f"with the reward manager's keyword arguments ({', '.join(call_args)}): {_one_line(err)}"
        }
    return {"ok": True}


def main() -> None:
    path, name = sys.argv[1], sys.argv[2]
    result = check(path, name, json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
    # The user's file may have replaced sys.stdout; the original one reaches the parent.
    sys.__stdout__.write(f"\n{MARKER}{json.dumps(result)}\n")
    sys.__stdout__.flush()


if __name__ == "__main__":
    main()
