"""The links of the Markdown pages, the anchors GitHub makes of their headings (so a
test can check that a link between pages leads somewhere), and their fenced blocks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> Iterator[tuple[Path, str]]:
    """Each relative link of the Markdown page ``path``, outside code blocks: the file
    it names (``path`` itself for "#anchor") and its anchor ("" for none)."""
    prose = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.M | re.S)
    for target in _LINK.findall(prose):
        if urlsplit(target).scheme:
            continue
        file, _, anchor = target.partition("#")
        yield (path.parent / file).resolve() if file else path, anchor


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of the headings of ``path``."""
    prose = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", prose, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def fenced(path: Path, language: str) -> Iterator[str]:
    """The text of each ```language block of ``path``."""
    yield from re.findall(rf"^```{language}\n(.*?)^```$", path.read_text(), re.M | re.S)


def fenced_with(path: Path, language: str, words: str) -> str:
    """The one ```language block of ``path`` that holds ``words``."""
    (block,) = [block for block in fenced(path, language) if words in block]
    return block
