"""The type-check habit mypy cannot enforce itself: a ``type: ignore`` says why, on its line.

mypy (``scripts/test.sh``) already rejects an ignore without an error code and one that is no
longer needed; this test adds that a reason follows it, as in
``x = y  # type: ignore[misc]  # torchft offers no hook for this``.
"""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan"

# "# type: ignore[code, ...]" then another comment with some text in it.
_EXPLAINED = re.compile(r"#\s*type:\s*ignore\[[^\]]+\]\s*#\s*\S")


def _type_ignores(path: Path) -> list[tuple[int, str]]:
    """(line, comment) of every comment in ``path`` that holds a ``type: ignore``; comments
    only, so the words inside a string or docstring do not count."""
    with path.open("rb") as f:
        return [
            (token.start[0], token.string)
            for token in tokenize.tokenize(f.readline)
            if token.type == tokenize.COMMENT and re.search(r"type:\s*ignore", token.string)
        ]


def test_every_type_ignore_in_the_package_says_why() -> None:
    unexplained = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {comment}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, comment in _type_ignores(path)
        if not _EXPLAINED.match(comment)
    ]
    assert not unexplained, (
        "each `# type: ignore[code]` needs a reason after it on the same line "
        "(`# type: ignore[code]  # why`):\n" + "\n".join(unexplained)
    )


def test_the_check_tells_an_explained_ignore_from_a_bare_one() -> None:
    assert _EXPLAINED.match("# type: ignore[misc]  # torchft offers no hook for this")
    assert not _EXPLAINED.match("# type: ignore[misc]")
    assert not _EXPLAINED.match("# type: ignore[misc]  #")
    assert not _EXPLAINED.match("# type: ignore  # no error code")
