"""The links of README.md and docs/ resolve: every relative link names an existing file or folder, every ``#anchor``
a heading of its target page (GitHub's rule), and every repository path the prose quotes in backticks
(``scripts/bench_zero.py``, ``configs/gpt_7b.yaml``, ``tests/gpu/``) exists.

GitHub's anchor of a heading: its text as rendered (code spans, links and emphasis reduced to their text), lower
case, every character but letters, digits, spaces, ``-`` and ``_`` dropped, spaces turned into ``-``; the second
heading of the same anchor gets ``-1``, the third ``-2``. Fenced code blocks and code spans are not links.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*(```+|~~~+)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
REPO_PATH = re.compile(r"^(?:configs|scripts|data|tests|docs|model|parallel|fp8|kernels|training|\.ci)/[\w./-]*$")


def prose_lines(text: str) -> List[Tuple[int, str]]:
    """(line number, line) of everything outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = CODE_SPAN.sub(lambda m: m.group(2), text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> List[str]:
    seen: Dict[str, int] = {}
    out = []
    for _, line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> List[Tuple[int, str]]:
    out = []
    for n, line in prose_lines(path.read_text()):
        bare = CODE_SPAN.sub("", line)
        out += [(n, m.group(1)) for m in INLINE_LINK.finditer(bare)]
        m = REFERENCE_DEF.match(bare)
        if m:
            out.append((n, m.group(1)))
    return out


def quoted_paths(path: Path) -> List[Tuple[int, str]]:
    return [(n, m.group(2).strip()) for n, line in prose_lines(path.read_text()) for m in CODE_SPAN.finditer(line)
            if REPO_PATH.match(m.group(2).strip())]


def dead_links(path: Path) -> List[str]:
    page = path.relative_to(ROOT).as_posix()
    dead = []
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this repository's
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            dead.append(f"{page}:{n}: {target}: no such file {file}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            dead.append(f"{page}:{n}: {target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    for n, quoted in quoted_paths(path):
        p = ROOT / quoted
        if not (p.exists() or p.with_name(p.name + ".bin").exists()):  # a .bin/.idx prefix names its pair
            dead.append(f"{page}:{n}: `{quoted}` does not exist")
    return dead


def test_the_checker_finds_links_anchors_and_paths():
    """The parsing works (a broken regex must not make the test below vacuous)."""
    assert slug("ZeRO++: qwZ, hpZ, qgZ") == "zero-qwz-hpz-qgz"
    assert slug("Compiled blocks (`train.compile`)") == "compiled-blocks-traincompile"
    assert slug("4-bit communication (SDP4Bit-style)") == "4-bit-communication-sdp4bit-style"
    assert slug("Sampling: `scripts/generate.py`") == "sampling-scriptsgeneratepy"
    assert slug("The [eager](x.md) trainer (before `train.compile`)") == "the-eager-trainer-before-traincompile"
    readme = links(ROOT / "README.md")
    assert len(readme) >= 20 and any(t.startswith("docs/") and "#" in t for _, t in readme)
    assert {p.name for p in PAGES} >= {"README.md", "benchmarks.md", "testing.md"}
    assert len(quoted_paths(ROOT / "docs" / "architecture.md")) >= 10


@pytest.mark.parametrize("path", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_no_dead_links(path: Path):
    dead = dead_links(path)
    assert not dead, "dead links:\n" + "\n".join(dead)
