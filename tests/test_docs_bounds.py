"""The docs keep their bounds (docs/performance.md, docs/lab/README.md): the README at most 150 lines with its two
commands in its first 15, docs/performance.md, the one current page, at most 300 (a table that replaces an old one
moves the old one to docs/lab/), and every relative markdown link between the docs lands on a file and, with an
anchor, on one of its headings as GitHub slugs it. The README's test command is the one CI (.ci/run) runs.

Each checker is shown to fail on a source built to break it (the negative controls)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = {"README.md": 150, "docs/performance.md": 300}
LINKED_FROM = ("README.md", "docs/*.md", "docs/lab/*.md")

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def over_bound(path: str, text: str, bound: int) -> str | None:
    """A message naming the file, its line count and the fix, or None when it is within ``bound``."""
    n = len(text.splitlines())
    if n <= bound:
        return None
    return (
        f"{path}: {n} lines, over its bound of {bound}: move older or supporting tables to docs/lab/ "
        f"(an existing lab page that fits, or a new one listed in docs/lab/README.md) and leave a one-line link"
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links kept as their text, lowercased, every character but
    letters, digits, underscores, hyphens and spaces removed, spaces to hyphens."""
    text = INLINE_LINK.sub(r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings (outside code fences); a repeated slug gets -1, -2, …"""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of each markdown link outside code fences and inline code."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out += [(i, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def broken_links(path: Path, root: Path) -> list[str]:
    """``file:line target: why`` for each relative link from ``path`` to a .md file (or to a heading of
    ``path`` itself) that does not resolve."""
    text = path.read_text()
    out = []
    for line, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        if file_part and not file_part.endswith(".md"):
            continue
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{line} {target}"
        if not dest.is_file():
            out.append(f"{where}: no such file")
        elif anchor and anchor not in anchors(dest.read_text()):
            out.append(f"{where}: no heading with that anchor in {dest.relative_to(root)}")
    return out


def test_the_readme_and_the_performance_page_keep_their_bounds():
    found = [over_bound(p, (ROOT / p).read_text(), b) for p, b in BOUNDS.items()]
    found = [f for f in found if f]
    assert not found, "; ".join(found)


def test_every_link_between_the_docs_lands_on_a_file_and_a_heading():
    files = sorted({p for pattern in LINKED_FROM for p in ROOT.glob(pattern)})
    assert len(files) > 10, "the doc globs find too few files"
    found = [b for p in files for b in broken_links(p, ROOT)]
    assert not found, "fix these links (GitHub's anchor: lowercase, spaces to hyphens, punctuation removed):\n" + (
        "\n".join(found)
    )


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"python -m pytest tests [^\n`]*--durations=\d+", readme)
    assert commands, "README.md has no full test command (python -m pytest tests … --durations=N)"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[0] in ci, f".ci/run does not run the README's test command {commands[0]!r}; keep the two in sync"


README_COMMANDS_WITHIN = 15


def commands_late(text: str, within: int = README_COMMANDS_WITHIN) -> list[str]:
    """The README's two commands (install and run, install and test) not found in its first ``within`` lines."""
    head = "\n".join(text.splitlines()[:within])
    wanted = ("bash scripts/install.sh && python examples/run_grpo.py", "bash scripts/install.sh && python -m pytest")
    return [c for c in wanted if c not in head]


def test_the_readme_gives_its_two_commands_first():
    late = commands_late((ROOT / "README.md").read_text())
    assert not late, f"README.md: move these commands into its first {README_COMMANDS_WITHIN} lines: {late}"
    # negative control: the same README with a screen of text above them
    assert len(commands_late("x\n" * 20 + (ROOT / "README.md").read_text())) == 2


def test_the_bound_check_names_the_file_its_count_and_the_fix():
    assert over_bound("README.md", "x\n" * 200, 200) is None
    msg = over_bound("README.md", "x\n" * 201, 200)
    assert msg and "README.md: 201 lines" in msg and "docs/lab/" in msg


def test_slugs_follow_githubs_rules():
    assert slug("Does speculation pay on the default run?") == "does-speculation-pay-on-the-default-run"
    assert slug("On a real model: SmolLM2-135M-Instruct") == "on-a-real-model-smollm2-135m-instruct"
    assert slug("The controller as the default (`speculation_control.mode: auto`)") == (
        "the-controller-as-the-default-speculation_controlmode-auto"
    )
    assert slug("Stops: SIGTERM, Ctrl-C, a full disk (rl_specdec/grpo/stop.py)") == (
        "stops-sigterm-ctrl-c-a-full-disk-rl_specdecgrpostoppy"
    )
    assert slug("On the Intel Xeon 2c AMX, in lockstep: the controller at 1.32x") == (
        "on-the-intel-xeon-2c-amx-in-lockstep-the-controller-at-132x"
    )
    assert anchors("# A\n```\n# B\n```\n## A\n") == {"a", "a-1"}


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# B\n\n## Where it pays: the wide pair\n```\n## Hidden\n```\n")
    a = tmp_path / "a.md"
    a.write_text(
        "# A\n[ok](b.md#where-it-pays-the-wide-pair) [ok](b.md) [ok](#a) [ok](https://x.org/c.md#z)"
        " [ok](c.py#L1) `[code](nowhere.md)`\n"
        "[gone](c.md) [stale](b.md#where-it-pays) [fenced](b.md#hidden) [self](#nothing)\n"
    )
    assert broken_links(a, tmp_path) == [
        "a.md:3 c.md: no such file",
        "a.md:3 b.md#where-it-pays: no heading with that anchor in b.md",
        "a.md:3 b.md#hidden: no heading with that anchor in b.md",
        "a.md:3 #nothing: no heading with that anchor in a.md",
    ]
