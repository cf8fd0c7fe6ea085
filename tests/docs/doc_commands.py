"""Dry-running the shell blocks of the docs: each command cut out of a block and checked for what it would do.

A command is checked by its program: `python SCRIPT ARGS` / `python -m MODULE ARGS` and `torchrun ... SCRIPT ARGS`
(with the launchers' own flags) through their argparse (argcheck.py, run once for all of them); `make TARGET` by
`make -n`; `pip install` by its pins, which must be one tested stack of pyproject.toml; `bash FILE` by `bash -n`
(and a wheelhouse's install.sh by the script scripts/wheelhouse.py writes, given the flags). A program the test
has no check for fails the block, so that a new kind of command gets a check, not a pass.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import ROOT, checkout_env

#: programs whose only check is bash -n of the block: file and folder handling that does nothing planning-specific
PLAIN = {"cd", "cp", "cat", "echo", "export", "ls", "mkdir", "split", "tar"}
_SEPARATORS = {";", "&&", "||", "|", "&"}
_REDIRECTS = {">", ">>", "<"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^(.*/)?python(3(\.\d+)?)?$")
_WHEELHOUSE = re.compile(r"^wheelhouse/torch(?P<torch>[\d.]+)-(?P<cuda>cu\d+|cpu)-py(?P<python>3\.\d+)/install\.sh$")
_STACK_PACKAGES = {"torch": "torch", "fbgemm-gpu": "fbgemm", "fbgemm-gpu-cpu": "fbgemm", "torchrec": "torchrec"}


@dataclass(frozen=True)
class Command:
    """One simple command of a block: its words, without leading VAR=value assignments and redirections."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def program(self) -> str:
        return self.argv[0]

    def __str__(self) -> str:
        return shlex.join(self.argv)


def commands(script: str) -> list[Command]:
    """The simple commands of a bash script, in order; ValueError on syntax a dry-run does not follow (subshells,
    substitutions, here-documents: keep dry-run blocks to plain commands)."""
    found: list[Command] = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        tokens = iter(lexer)
        for token in tokens:
            if token in _SEPARATORS:
                found += _command(words)
                words = []
            elif token in _REDIRECTS:
                next(tokens, None)
            elif set(token) <= set(";&|<>()") or "$(" in token or "`" in token:
                raise ValueError(f"shell syntax the dry-run does not follow: {token!r} in {line!r}")
            else:
                words.append(token)
        found += _command(words)
    return found


def _command(words: list[str]) -> list[Command]:
    env = {}
    while words and _ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return [Command(tuple(words), env)] if words else []


def python_invocation(cmd: Command) -> list[str] | None:
    """The interpreter's arguments when `cmd` runs Python code (python, torchrun), else None."""
    name = Path(cmd.program).name
    if _PYTHON.match(cmd.program):
        return list(cmd.argv[1:])
    if name == "torchrun":
        return ["-m", "torch.distributed.run", *cmd.argv[1:]]
    return None


def stacks() -> dict[str, dict[str, str]]:
    """pyproject.toml's tested stacks: TorchRec minor -> {torch, fbgemm, torchrec, pypi_cuda}."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["embark-torchrec"]["stacks"]


def check_make(cmd: Command) -> str | None:
    """`make ARGS` must name targets the Makefile has: `make -n` (prints, runs nothing) exits 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    proc = subprocess.run(
        ["make", "-n", *cmd.argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    return None if proc.returncode == 0 else f"{cmd}: make -n exited {proc.returncode}: {proc.stderr[-1500:]}"


def check_pip(cmd: Command, pins: dict[str, str]) -> str | None:
    """`pip install` of the stack's packages at a tested stack's versions (`pins` gathers them over the block, so
    that one block installs one stack), or of this project's wheel at pyproject.toml's version."""
    if cmd.argv[1:2] != ("install",):
        return f"{cmd}: only pip install is dry-run"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    own: dict[str, str] = {}
    args = iter(cmd.argv[2:])
    for arg in args:
        if arg in ("--index-url", "--extra-index-url", "--find-links"):
            next(args, None)
        elif arg.startswith("-"):
            continue
        elif arg.endswith(".whl"):
            if not re.fullmatch(rf"embark_torchrec-{re.escape(version)}-py3-none-any\.whl", Path(arg).name):
                return f"{cmd}: {arg} is not this project's wheel at version {version}"
        else:
            name, sep, pinned = arg.partition("==")
            if name not in _STACK_PACKAGES or not sep:
                return f"{cmd}: {arg}: the docs install the stack's packages pinned (torch, fbgemm-gpu[-cpu], torchrec)"
            own[name] = pinned
    if not own:
        return None
    pins.update(own)
    matching = [minor for minor, s in stacks().items() if all(s[_STACK_PACKAGES[n]] == v for n, v in pins.items())]
    return None if matching else f"{cmd}: pins {pins} are not one tested stack of pyproject.toml ({stacks()})"


def check_bash(cmd: Command) -> str | None:
    """`bash FILE ARGS`: a file of this repository passes bash -n; a wheelhouse's install.sh (made by `make
    wheelhouse`) is written by scripts/wheelhouse.py for that folder's stack and accepts ARGS (it exits 2 on an
    unknown one, 0 on the --help after them)."""
    if len(cmd.argv) < 2:
        return f"{cmd}: bash without a file"
    path = cmd.argv[1]
    if (ROOT / path).is_file():
        proc = subprocess.run(["bash", "-n", str(ROOT / path)], capture_output=True, text=True, timeout=30)
        return None if proc.returncode == 0 else f"{cmd}: bash -n {path}: {proc.stderr}"
    m = _WHEELHOUSE.match(path)
    if not m:
        return f"{cmd}: {path} is neither a file of this repository nor a wheelhouse's install.sh"
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import wheelhouse
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    try:
        stack = wheelhouse.stack_for_torch(m["torch"])
    except wheelhouse.WheelhouseError as e:
        return f"{cmd}: {e}"
    manifest = {
        "torch": stack["torch"],
        "cuda": m["cuda"].removeprefix("cu"),
        "python": m["python"],
        "platform": "manylinux_2_28_x86_64",
        "fbgemm": f"fbgemm-gpu=={stack['fbgemm']}",
        "torchrec": stack["torchrec"],
        "embark_torchrec": "0",
        "wheels": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "install.sh"
        script.write_text(wheelhouse.install_script(manifest))
        proc = subprocess.run(
            ["bash", str(script), *cmd.argv[2:], "--help"], capture_output=True, text=True, timeout=30, check=False
        )
    return None if proc.returncode == 0 else f"{cmd}: install.sh refuses its arguments: {proc.stderr}"


def static_problems(script: str, pins: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """bash -n of the script, the checks of every command that needs no Python, and the Python invocations left
    for argcheck.py."""
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        return [f"bash -n: {proc.stderr}"], []
    problems: list[str] = []
    invocations: list[list[str]] = []
    for cmd in commands(script):
        name = Path(cmd.program).name
        python = python_invocation(cmd)
        if python is not None:
            invocations.append(python)
        elif name == "make":
            problems.append(check_make(cmd))
        elif name == "pip":
            problems.append(check_pip(cmd, pins))
        elif name == "bash":
            problems.append(check_bash(cmd))
        elif name not in PLAIN:
            problems.append(f"{cmd}: no dry-run check for {name!r} (add one to tests/docs/doc_commands.py)")
    return [p for p in problems if p], invocations


def check_invocations(invocations: list[list[str]], timeout_s: float) -> list[str | None]:
    """argcheck.py on every invocation in one process (the scripts' torch and torchrec imports are paid once): per
    invocation None, or why its arguments are refused."""
    if not invocations:
        return []
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"argcheck-{os.getpid()}.json"
    env = checkout_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("argcheck.py")), str(out)],
        input=json.dumps(invocations),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode:
        raise RuntimeError(f"argcheck.py exited {proc.returncode}: {proc.stderr[-3000:]}")
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink()
