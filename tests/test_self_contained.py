"""The repository stands alone: it names no file outside it, and its Markdown links resolve.

Facts and figures the code relies on live in docs/background.md and the design in
docs/design.md; nothing may point at notebooks kept outside the repository. Every
relative link in the Markdown documentation must reach a file or folder of the
repository, and a link to a heading must reach a heading that exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Names of documents kept outside the repository. Spelled in pieces, so that this file
# does not name them itself.
OUTSIDE = tuple(
    "".join(parts)
    for parts in (
        ("FACTS", ".md"),
        ("DESIGN", ".md"),
        ("STYLE", ".md"),
        ("REAL-PEERS", ".md"),
        ("CONTROL-PLANE", ".md"),
        ("../", "shared/"),
        ("/work/", "shared"),
    )
)

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]"  # [text], which may hold one level of brackets
    r"\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)"  # (target "optional title")
)
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"""<a\s[^>]*(?:name|id)=["']([^"']+)["']""")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")

IN_GIT = shutil.which("git") is not None and (REPO / ".git").exists()
pytestmark = pytest.mark.skipif(not IN_GIT, reason="needs a git checkout to list its files")


@cache
def repo_files() -> frozenset[str]:
    """The repository's files: tracked, plus untracked ones that git does not ignore."""
    if not IN_GIT:
        return frozenset()
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return frozenset(p for p in listed.split("\0") if p and (REPO / p).is_file())


@cache
def repo_dirs() -> frozenset[str]:
    dirs = {""}
    for path in repo_files():
        parts = path.split("/")[:-1]
        dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return frozenset(dirs)


def text_files() -> list[str]:
    out = []
    for path in sorted(repo_files()):
        data = (REPO / path).read_bytes()
        if b"\0" not in data[:8192]:
            out.append(path)
    return out


def markdown_files() -> list[str]:
    return sorted(p for p in repo_files() if p.endswith(".md"))


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: rendered text, lower case, punctuation dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: str) -> frozenset[str]:
    """The anchors of a Markdown file: its headings' slugs (numbered when repeated), HTML ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in (REPO / path).read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ID.findall(line))
        if match := HEADING.match(line):
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(path: str) -> list[tuple[int, str]]:
    out = []
    for number, line in prose_lines((REPO / path).read_text(encoding="utf-8")):
        for match in INLINE_LINK.finditer(line):
            out.append((number, match.group(1).strip("<>")))
        ref = REFERENCE.match(line)
        if ref:
            out.append((number, ref.group(1).strip("<>")))
    return out


def broken(source: str, target: str) -> str | None:
    """Why a link from ``source`` to ``target`` does not resolve, or None when it does."""
    if SCHEME.match(target) or target.startswith("//"):
        return None  # an external address
    location, _, fragment = target.partition("#")
    location = location.split("?", 1)[0]
    if location.startswith("/"):
        return "absolute paths do not resolve on every viewer; use a relative link"
    if location:
        resolved = (REPO / source).parent / location
        try:
            rel = resolved.resolve().relative_to(REPO).as_posix()
        except ValueError:
            return "points outside the repository"
        rel = "" if rel == "." else rel
        if rel not in repo_files() and rel not in repo_dirs():
            return "no such file or folder in the repository"
    else:
        rel = source
    if fragment and rel.endswith(".md") and rel in repo_files():
        if fragment.lower() not in anchors(rel):
            return f"no heading #{fragment} in {rel}"
    return None


def test_nothing_names_documents_outside_the_repository() -> None:
    offenders = []
    for path in text_files():
        text = (REPO / path).read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            offenders.extend(f"{path}:{number}: {name}" for name in OUTSIDE if name in line)
    assert not offenders, "files outside the repository are named:\n" + "\n".join(offenders)


def test_documentation_exists_and_is_linked_from_the_readme() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for page in ("docs/design.md", "docs/background.md"):
        assert page in repo_files(), page
        assert f"]({page}" in readme, f"README.md does not link {page}"


@pytest.mark.parametrize("source", markdown_files())
def test_relative_markdown_links_resolve(source: str) -> None:
    problems = [
        f"{source}:{number}: ({target}) {why}"
        for number, target in links(source)
        if (why := broken(source, target)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_the_link_checker_sees_links() -> None:
    found = [target for _, target in links("README.md")]
    assert "docs/design.md" in found
    assert broken("README.md", "docs/no-such-page.md") is not None
    assert broken("README.md", "../outside.md") is not None
    assert broken("README.md", "docs/design.md#no-such-heading") is not None
    assert broken("README.md", "docs/design.md#layout") is None
    assert broken("README.md", "https://example.com/x.md") is None
