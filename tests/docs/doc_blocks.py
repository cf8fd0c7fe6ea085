"""The fenced code blocks of README.md and docs/*.md, each with what the doc test does with it.

Every block carries an HTML comment on the line directly above its opening fence:

    <!-- doc: run -->        executed: Python and shell blocks run, JSON blocks are read as a spec or plan file
    <!-- doc: dry-run -->    parsed and checked, not run (several nodes, a GPU, root, a network, minutes)
    <!-- doc: output -->     shown output or a format sketch; only for languages that cannot run

and optionally `timeout=SECONDS` (default 60) or `ranks=N` (a Python block runs as a torchrun job of N processes;
default 1). A block without an annotation, or with one the test does not know, is a problem the test reports:
nothing in the docs is left out silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import ROOT

KINDS = ("run", "dry-run", "output")
OPTIONS = ("timeout", "ranks")
#: fence language -> what the test treats it as
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "console"}
#: kinds each treated language may take; every other language (json aside) is output only
ALLOWED = {
    "python": {"run", "dry-run"},
    "bash": {"run", "dry-run"},
    "console": {"run", "dry-run"},
    "json": {"run", "output"},
}

_ANNOTATION = re.compile(r"<!--\s*doc:\s*(?P<body>.*?)\s*-->")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, its text and its annotation (None when missing)."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    kind: str | None
    options: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def name(self) -> str:
        """`README.md:17`: where a reader finds it."""
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def language(self) -> str:
        """python, bash or console for the languages the test runs; otherwise the fence's own word."""
        return LANGUAGES.get(self.lang, self.lang)

    @property
    def timeout_s(self) -> float:
        return float(self.options.get("timeout", 60))

    @property
    def ranks(self) -> int:
        return int(self.options.get("ranks", 1))

    def shell(self) -> str:
        """The block as a bash script: a console block's `$ ` lines (and their continuations), else its text."""
        if self.language != "console":
            return self.text
        lines, continuing = [], False
        for line in self.text.splitlines():
            if line.startswith("$ ") or continuing:
                lines.append(line[2:] if line.startswith("$ ") and not continuing else line)
                continuing = line.endswith("\\")
        return "\n".join(lines) + "\n"


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The blocks of one Markdown file, and what is wrong with its fences and annotations."""
    blocks: list[Block] = []
    problems: list[str] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        annotation = _ANNOTATION.fullmatch(lines[i].strip())
        if annotation and not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
            problems.append(f"{path.name}:{i + 1}: a doc annotation not directly above a code fence")
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            problems.append(f"{path.name}:{start + 1}: code fence never closed")
        i += 1
        above = _ANNOTATION.fullmatch(lines[start - 1].strip()) if start else None
        kind, options = None, {}
        if above:
            kind, *rest = above["body"].split()
            for word in rest:
                key, sep, value = word.partition("=")
                if not sep or key not in OPTIONS:
                    problems.append(f"{path.name}:{start + 1}: unknown doc option {word!r} (known: {OPTIONS})")
                options[key] = value
        lang = info.split()[0].lower() if info else ""
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", kind, options))
    return blocks, problems


def collect(root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """Every block of the docs, and every problem: unannotated blocks, unknown kinds, kinds a language cannot take."""
    blocks: list[Block] = []
    problems: list[str] = []
    for path in doc_files(root):
        found, wrong = parse(path)
        blocks += found
        problems += wrong
    for b in blocks:
        allowed = ALLOWED.get(b.language, {"output"})
        if b.kind is None:
            problems.append(f"{b.name}: ```{b.lang} block without a <!-- doc: run|dry-run|output --> line above it")
        elif b.kind not in KINDS:
            problems.append(f"{b.name}: unknown doc kind {b.kind!r} (known: {KINDS})")
        elif b.kind not in allowed:
            problems.append(f"{b.name}: a ```{b.lang} block cannot be '{b.kind}' (it may be {sorted(allowed)})")
    return blocks, problems
