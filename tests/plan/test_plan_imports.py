"""plan/ is pure and layered: every module of it, in every sub-package, imports without torch (so without
torch.distributed), torchrec or fbgemm, in a fresh interpreter (the planner CLI and a laptop need none of them, and
the CLI starts in well under a second); statically, no import of it, at any level (function-level and TYPE_CHECKING
ones included), leaves plan/ except for the standard library and numpy, yaml, matplotlib (so no arrow to planner/,
sharding/ or the runtime); and no import circle inside it spans more than two files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import embark_torchrec.plan as plan_package

PACKAGE = plan_package.__name__
ROOT = Path(plan_package.__file__).parent
# beside the standard library: numpy, yaml (spec and hardware files), matplotlib (--plot, the [plot] extra)
THIRD_PARTY = {"numpy", "yaml", "matplotlib"}
LARGEST_CIRCLE = 2  # files: kinds <-> tables, TableLayout's kind and the kind's TYPE_CHECKING TableLayout


def _modules() -> dict[str, Path]:
    """Every module of plan/ by dotted name, packages (their __init__) included."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth: `from a import b` names a.b where that is a module
    of plan/, else a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_plan_module_imports_without_torch_or_torchrec(module: str) -> None:
    # __main__ runs the CLI on import: asked for --help, it exits once its imports are done
    code = (
        "import sys, importlib; sys.argv = ['plan', '--help']\n"
        f"try:\n    importlib.import_module({module!r})\nexcept SystemExit:\n    pass\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'torchrec', 'fbgemm_gpu'))\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{module} pulls in {proc.stdout.strip()[-2000:]} {proc.stderr[-2000:]}"


def test_plan_imports_only_its_own_modules_the_standard_library_and_numpy() -> None:
    """No arrow out of plan/ (to planner/, sharding/, torch); and inside it a module imports a module, never a
    package's re-exports (plan/__init__ imports every stage, so `from embark_torchrec.plan import X` in a stage would
    close an import circle through it)."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{line}: {name}"
        for module, path in MODULES.items()
        for line, name in _imports(module, path)
        if name in packages
        or not (name.startswith(PACKAGE + ".") or name.split(".")[0] in sys.stdlib_module_names | THIRD_PARTY)
    ]
    assert not wrong, "plan/ imports from outside its own modules:\n" + "\n".join(wrong)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of the graph (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found


def test_no_import_circle_inside_plan_spans_more_than_two_files() -> None:
    """Every import counts, TYPE_CHECKING and function-level ones too: a type-only circle still means neither file
    can be read without the other. A submodule importing a name from the package (`from embark_torchrec.plan import
    X`) closes a circle through plan/__init__, which imports the user-facing names of every stage."""
    edges = {m: {name for _, name in _imports(m, p) if name in MODULES and name != m} for m, p in MODULES.items()}
    circles = [c for c in _circles(edges) if len(c) > LARGEST_CIRCLE]
    assert not circles, f"import circles in plan/: {circles}"


@pytest.mark.parametrize("missing", ["torchrec", "fbgemm_gpu"])
def test_runtime_without_torchrec_or_fbgemm_says_what_to_install(missing: str) -> None:
    """The wheel does not require torchrec or fbgemm (torchrec's metadata would pull the CUDA fbgemm-gpu onto CPU
    users), so where one is missing the runtime's first use says which package to install and where the README says
    how, instead of a bare "No module named"."""
    code = (
        "import sys\n"
        "class Gone:  # the package is not installed\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {missing!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Gone())\n"
        "import embark_torchrec\n"
        "try:\n    embark_torchrec.EmbarkEmbeddingBagCollectionSharder\n"
        "except ModuleNotFoundError as e:\n    print(e.name, '|', e)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    name, _, message = proc.stdout.strip().partition(" | ")
    assert name == missing, proc.stdout + proc.stderr[-2000:]
    assert f"needs {missing}, which pip does not install with embark-torchrec" in message, message
    assert "'Install with pip'" in message, message
