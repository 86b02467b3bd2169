"""Cross-references in the pages resolve: every relative Markdown link of a page
names a file of the checkout and, with a ``#fragment``, a heading of that page as
GitHub anchors it (`helpers.pages`); and no page sends its reader to a section by
its name alone ("see Policies above", where Policies is a section of another
file). The pages: README.md, SECURITY.md, client/README.md and docs/*.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.pages import anchors, links

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "client" / "README.md",
                *(ROOT / "docs").glob("*.md")])  # fmt: skip
IDS = [str(page.relative_to(ROOT)) for page in PAGES]
#: A Markdown link, taken out of a text before it is searched for `BY_NAME`.
LINK = re.compile(r"\[[^\]]*\]\([^)\s]+\)")
#: A section referred to by its name: "see" then a capitalised word.
BY_NAME = re.compile(r"\b[Ss]ee\s+(?:the\s+)?[A-Z]")


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """What of ``page``'s relative links does not resolve within ``root``."""
    wrong = []
    for file, anchor in links(page):
        target = f"{file.name}#{anchor}" if anchor else file.name
        if not file.is_relative_to(root):
            wrong.append(f"{target}: outside the checkout")
        elif not file.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            wrong.append(f"{target}: no such heading")
    return wrong


def named_sections(text: str) -> list[str]:
    """Where ``text`` (its code blocks too: a comment there cannot link) refers to
    a section by its name alone, as ``line: the line``."""
    # A link is taken out with the line ends it spans, so lines keep their numbers.
    unlinked = LINK.sub(lambda link: "\n" * link.group().count("\n"), text)
    lines = text.split("\n")
    numbers = [unlinked.count("\n", 0, found.start()) for found in BY_NAME.finditer(unlinked)]
    return [f"{number + 1}: {lines[number].strip()}" for number in numbers]


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken(page) == []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_a_section_is_referred_to_by_a_link_not_by_its_name(page: Path) -> None:
    assert named_sections(page.read_text(encoding="utf-8")) == []


def test_the_checks_find_a_missing_file_a_wrong_anchor_and_a_bare_reference(
    tmp_path: Path,
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## Two `words`\n\n## Two `words`\n")
    page = docs / "b.md"
    page.write_text(
        "[one](a.md#two-words) [two](a.md#two-words-1) [me](#b) [web](https://example.com/c)\n"
        "[gone](c.md) [anchor](a.md#nowhere) [up](../../x.md) [over\ntwo lines](d.md)\n"
        "```\n[code](e.md)\n```\n# B\n"
    )
    assert broken(page, tmp_path) == [
        "c.md: no such file",
        "a.md#nowhere: no such heading",
        "x.md: outside the checkout",
        "d.md: no such file",
    ]
    text = "```\nx = 1  # see Policies above\n```\n(see Benchmarks)\nsee\nJobs"
    assert named_sections(text) == [
        "2: x = 1  # see Policies above",
        "4: (see Benchmarks)",
        "5: see",
    ]
    linked = "see [Policies](policies.md#policies), see\n[Storage\nand crashes](s.md), see that"
    assert named_sections(linked) == []
