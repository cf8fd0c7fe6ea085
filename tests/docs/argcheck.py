"""Runs Python programs up to their argument parsing, and no further: does the program accept the docs' flags?

Usage: python argcheck.py OUT.json < invocations.json, where each invocation is a Python command line without the
interpreter (`["-m", "embark_torchrec.plan", "dcnv2", "--world-size", "8", ...]` or `["examples/dlrm/train.py",
...]`). Each program runs as `__main__` with `argparse.ArgumentParser.parse_args` wrapped: the real parse runs (so
an unknown flag or a bad value fails as it would for a user), and then the wrapper stops the program before it does
anything (a program that has not parsed its arguments within PARSE_WITHIN_S is stopped and refused). A launcher's
own command (torchrun's script, the emulated cluster's after `--`) is checked the same way. OUT.json gets, per
invocation, null or why it was refused.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import runpy
import signal
import sys
from pathlib import Path
from typing import Any


class Parsed(BaseException):
    """Raised by the wrapped parse_args once the arguments parsed: a BaseException, so no `except Exception` in the
    program swallows it."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


class NotParsed(BaseException):
    """Raised when a program has not reached argparse in PARSE_WITHIN_S: it parses some other way (pytest does), or
    does its work first; either way the dry-run cannot check it and must not let it run on."""


#: how long a program may take to reach its argument parsing (imports included; torchrec's take seconds)
PARSE_WITHIN_S = 60
_parse_args = argparse.ArgumentParser.parse_args


def _not_parsed(signum: int, frame: object) -> None:
    raise NotParsed()


def _stop_after_parse(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> argparse.Namespace:
    raise Parsed(_parse_args(self, *args, **kwargs))


def _inner(module: str | None, ns: argparse.Namespace) -> list[str] | None:
    """The command a launcher would start, from its parsed arguments; None for a program that launches nothing."""
    if module == "torch.distributed.run":
        if ns.no_python:
            return None
        return (["-m", ns.training_script] if ns.module else [ns.training_script]) + list(ns.training_script_args)
    if module == "embark_torchrec.cluster":
        return list(ns.script[1:] if ns.script[:1] == ["--"] else ns.script)
    return None


def _run_as_main(module: str | None, invocation: list[str]) -> None:
    """Runs `python *invocation` in this process, as the interpreter would (sys.argv, the script's folder first on
    sys.path)."""
    if module is not None:
        sys.argv = [module, *invocation[2:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = Path(invocation[0])
        sys.argv = [str(script), *invocation[1:]]
        sys.path.insert(0, str(script.resolve().parent))
        runpy.run_path(str(script), run_name="__main__")


def check(invocation: list[str]) -> str | None:
    """None when the program parses `invocation`'s arguments (and a launcher's command does too), else why not."""
    if not invocation or (invocation[0].startswith("-") and invocation[0] != "-m") or invocation == ["-m"]:
        return f"{invocation}: expected SCRIPT ARGS or -m MODULE ARGS"
    module = invocation[1] if invocation[0] == "-m" else None
    if module is not None and importlib.util.find_spec(module) is None:
        return f"no module {module!r}"
    if module is None and not Path(invocation[0]).is_file():
        return f"no script {invocation[0]}"
    said = io.StringIO()
    signal.alarm(PARSE_WITHIN_S)
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            _run_as_main(module, invocation)
    except Parsed as parsed:
        signal.alarm(0)
        inner = _inner(module, parsed.namespace)
        return None if inner is None else check(inner)
    except NotParsed:
        return f"{' '.join(invocation)}: did not parse its arguments with argparse within {PARSE_WITHIN_S} s"
    except SystemExit as e:
        return f"{' '.join(invocation)}: exited {e.code} before its arguments parsed: {said.getvalue()[-1500:]}"
    except Exception as e:  # noqa: BLE001 - the program's own refusal of its arguments (e.g. a UsageError)
        return f"{' '.join(invocation)}: {type(e).__name__}: {e} {said.getvalue()[-1500:]}"
    finally:
        signal.alarm(0)
    return f"{' '.join(invocation)}: ran to the end without parsing arguments with argparse"


def main() -> None:
    out = Path(sys.argv[1])
    argparse.ArgumentParser.parse_args = _stop_after_parse  # type: ignore[method-assign]
    signal.signal(signal.SIGALRM, _not_parsed)
    results = [check(invocation) for invocation in json.load(sys.stdin)]
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
