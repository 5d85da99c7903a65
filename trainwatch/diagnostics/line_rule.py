"""One message form of the log rules (LineRule) and the small helpers every rule table uses."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


def words(phrase: str) -> str:
    """Regex for a phrase whose spaces may be lost or doubled.

    Terminals and issue trackers wrap long messages; joining the pieces back
    drops or doubles the space at the break, so every word gap is optional.
    """
    return r"\s*".join(re.escape(word) for word in phrase.split())


@dataclass(frozen=True, slots=True)
class LineRule:
    """One message form: the regex that finds it and how to read its facts."""

    name: str
    """Short id naming the message form in the table."""
    needle: str
    """Lower-case word every instance contains; without it the regex is not tried."""
    category: str
    """Error category the message proves."""
    pattern: re.Pattern[str]
    """Compiled regex; its named groups carry the facts."""
    read: Callable[[re.Match[str]], dict]
    """Match -> facts (finding fields and extra keys)."""
    role: str = "finding"
    """"finding"; "support" (only adds facts to a finding); "hint" (dropped beside a specific CUDA finding)."""
    family: str = ""
    """Rules of one family are exclusive on a line: the first listed wins."""
    runbook: str | None = None
    """Runbook for this message when it is more specific than its category's; None: the category's."""


def rank_list(m: re.Match[str]) -> list[int]:
    """The ranks a message lists ("Ranks 1, 3 failed ...", "rank=[1, 2, 3]")."""
    return [int(r) for r in re.findall(r"\d+", m.group("ranks"))]


def nothing(m: re.Match[str]) -> dict:
    """A message whose only fact is its category."""
    return {}
