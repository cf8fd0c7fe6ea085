"""Every code block of README.md and docs/*.md runs, or is dry-run, so that the docs cannot drift from the code.

Which one is the block's own annotation (doc_blocks.py); a block without one fails. `run`: a Python block runs in a
fresh interpreter in a temporary folder, with this checkout on PYTHONPATH, as rank 0 of a one-rank torchrun job
(RANK, WORLD_SIZE, MASTER_ADDR/PORT set, so `dist.init_process_group("gloo")` works as under torchrun), or under
torchrun itself with `ranks=N`; a shell block runs under `bash -e` in a temporary folder that links this checkout's
files and `.venv` to the running interpreter's environment; a JSON block is read as the spec or plan file it shows.
`dry-run`: a shell block passes `bash -n` and every command its check (doc_commands.py: the programs' argparse,
`make -n`, pip pins); a Python block compiles and every name it imports exists. Markdown links between the pages,
and the repository files the pages name, must exist.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.doc_blocks import ROOT, Block, collect, doc_files, parse
from tests.docs.doc_commands import check_invocations, commands, static_problems
from tests.support.processes import checkout_env

BLOCKS, PROBLEMS = collect()
#: repository folders whose files the pages may name in backticks; each named file must exist
NAMED_ROOTS = ("embark_torchrec/", "benchmarks/", "examples/", "scripts/", "docs/", "tests/")


def _blocks(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    """The checkout's environment, with the running interpreter's `python` and `torchrun` first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return checkout_env(PATH=path, OMP_NUM_THREADS="1", **extra)


def _checkout(where: Path) -> None:
    """Links this checkout's top-level files into `where`, and `.venv` to the running interpreter's environment,
    so that a block's `.venv/bin/python benchmarks/...` means what it means in a set-up checkout."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (where / entry.name).symlink_to(entry)
    (where / ".venv").symlink_to(Path(sys.prefix))


def _said(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def test_every_block_is_annotated_and_every_fence_closed() -> None:
    """A block the test would not know what to do with fails here, by file and line."""
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_the_collector_refuses_what_it_cannot_place(tmp_path: Path) -> None:
    """An unannotated block, an annotation with a blank line before its fence, an `output` Python block and an
    unclosed fence are each reported."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- doc: run -->\n\n```bash\ntrue\n```\n"
        "<!-- doc: output -->\n```python\ny = 2\n```\n<!-- doc: run -->\n```bash\nfalse\n"
    )
    blocks, problems = parse(page)
    assert [b.line for b in blocks] == [1, 7, 11, 15]
    assert [b.kind for b in blocks] == [None, None, "output", "run"]
    assert any("not directly above a code fence" in p for p in problems), problems
    assert any("never closed" in p for p in problems), problems


@pytest.mark.parametrize("block", _blocks("run"), ids=lambda b: b.name)
def test_run_block(block: Block, tmp_path: Path) -> None:
    """The block runs to exit 0 (a JSON block: reads as the file it shows)."""
    if block.language == "json":
        _read_json_block(block, tmp_path)
        return
    if block.language == "python" and block.ranks > 1:
        (tmp_path / "block.py").write_text(block.text)
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={block.ranks}"]
        cmd, env = [sys.executable, *launch, "block.py"], _env()
    elif block.language == "python":
        (tmp_path / "block.py").write_text(block.text)
        cmd = [sys.executable, "block.py"]
        env = _env(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    else:
        _checkout(tmp_path)
        (tmp_path / "block.sh").write_text(block.shell())
        cmd, env = ["bash", "-e", "-o", "pipefail", "block.sh"], _env()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=block.timeout_s)
    assert proc.returncode == 0, f"{block.name}:\n{block.text}\n{_said(proc)}"


def _read_json_block(block: Block, tmp_path: Path) -> None:
    """A plan file (`"format": "embark-plan"`) or a model spec, read by the readers that read users' files."""
    from embark_torchrec.plan import Plan, load_model_spec

    path = tmp_path / "block.json"
    path.write_text(block.text)
    if json.loads(block.text).get("format") == "embark-plan":
        Plan.load(path)
    else:
        load_model_spec(path)


@pytest.fixture(scope="module")
def dry_run_checks() -> dict[str, list[str]]:
    """Per dry-run shell block, what is wrong with it: its static checks here, and its Python invocations checked
    in one argcheck.py process for all blocks."""
    pins: dict[str, dict[str, str]] = {}
    found: dict[str, list[str]] = {}
    invocations: list[tuple[str, list[str]]] = []
    for block in _blocks("dry-run"):
        if block.language == "python":
            continue
        problems, python = static_problems(block.shell(), pins.setdefault(block.name, {}))
        found[block.name] = problems
        invocations += [(block.name, inv) for inv in python]
    results = check_invocations([inv for _, inv in invocations], timeout_s=300)
    for (name, _), result in zip(invocations, results):
        if result is not None:
            found[name].append(result)
    return found


@pytest.mark.parametrize("block", _blocks("dry-run"), ids=lambda b: b.name)
def test_dry_run_block(block: Block, dry_run_checks: dict[str, list[str]], tmp_path: Path) -> None:
    """A shell block's commands exist and accept the flags shown; a Python block compiles and its imports resolve."""
    if block.language == "python":
        _check_python_imports(block, tmp_path)
        return
    assert commands(block.shell()), f"{block.name}: a dry-run block with no command"
    assert not dry_run_checks[block.name], f"{block.name}:\n" + "\n".join(dry_run_checks[block.name])


def _check_python_imports(block: Block, tmp_path: Path) -> None:
    """compile() of the block, then every `import X` / `from X import Y` of it resolved in a fresh interpreter."""
    tree = ast.parse(block.text, filename=block.name)
    imports = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports, f"{block.name}: a dry-run Python block that imports nothing checks nothing"
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(imports)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{block.name}: its imports fail\n{_said(proc)}"


_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_NAMED = re.compile(r"`(?P<path>(?:" + "|".join(map(re.escape, NAMED_ROOTS)) + r")[\w./-]*[\w/])`")
_TEST_FILE = re.compile(r"`(?P<name>test_\w+\.py)`")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+\s+(.*)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_and_named_files_exist() -> None:
    """Each relative link (and its #anchor) between the pages resolves, each path under NAMED_ROOTS named in
    backticks exists, and each `test_*.py` named is a test file."""
    tests = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for page in doc_files():
        text = page.read_text()
        for m in _LINK.finditer(text):
            target, _, anchor = m["target"].partition("#")
            if re.match(r"^[a-z]+:", target):
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                missing.append(f"{page.name}: link to {m['target']}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                missing.append(f"{page.name}: link to {m['target']}: no such heading")
        missing += [f"{page.name}: {m['path']}" for m in _NAMED.finditer(text) if not (ROOT / m["path"]).exists()]
        missing += [f"{page.name}: {m['name']}" for m in _TEST_FILE.finditer(text) if m["name"] not in tests]
    assert not missing, "\n".join(missing)
