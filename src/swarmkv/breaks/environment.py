"""Per-instance environment text: what two runs of one harness in two workspaces write differently.

Harnesses put their environment into the prompt: the working directory (Claude Code, Codex and Qwen Code
all do), paths under HOME or named after the project (a memory folder), the git commit at the start, the
user and host names. Each is one value, stable within an instance's session and different in the next
instance. A value is found on its line:

- an absolute path (`/...`, `~/...`, `C:\\...`): the `working directory` when its line says so (`cwd`,
  `working directory`, `workspace`, ...), else a `path` (one with at least two parts, so a lone `/help`
  is no path);
- a `git hash`: 7 to 40 hex digits, digits and letters, on a line naming git or a commit, or just below one;
- a `git branch`: after `Current branch:`, `On branch`, `branch:` (a git status a harness writes; each worktree
  has its own), the line's last word;
- a `user name` or `host name`: after `user:`, `hostname=`..., or as `user@host` (not an e-mail address).

A value is `cued` when its line says what it is (a working directory, a commit, a user): environment text
wherever it stands. An uncued path is environment text only in the shared head (the system prompt),
where any per-instance text costs every later token its sharing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

_PATH = re.compile(
    r"(?<![\w.~/:@<-])(?:~|[A-Za-z]:)?/[\w.@+-]+(?:/[\w.@+-]*)*"  # POSIX, ~/..., C:/... (not a closing tag)
    r"|(?<![\w\\])[A-Za-z]:\\[\w.@+-]+(?:\\[\w.@+-]*)*"  # C:\Users\...
)
_WORKING_DIRECTORY = re.compile(
    r"(?i)working\s+(?:directory|dir)|\bcwd\b|\bpwd\b|current\s+directory|in\s+the\s+directory"
    r"|workspace|project\s+(?:root|directory)"
)
_GIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
_GIT_CUE = re.compile(r"(?i:\b(?:git|commits?|sha1?|revision)\b)|\bHEAD\b")
# A name ends its line or a field (`User: ada`, `user=ada,`, `<hostname>box</hostname>`): never a word of prose.
_END_OF_FIELD = r"(?=`?\s*(?:$|[,;)\]<]))"
_USER = re.compile(r"(?i)\b(?:user(?:\s*name)?|login)\s*[:=>]\s*`?([A-Za-z_][\w.-]{0,31})" + _END_OF_FIELD)
_HOST = re.compile(
    r"(?i)\b(?:host\s*(?:name)?|machine(?:\s+name)?|computer\s+name)\s*[:=>]\s*`?([A-Za-z0-9][\w.-]{0,62})"
    + _END_OF_FIELD
)
# A git branch where a harness writes its git status: `Current branch: agent-1` (Claude Code), `On branch x`,
# `branch: x`, `Branch: x`; each worktree of a project has its own.
_GIT_BRANCH = re.compile(
    r"(?i)\b(?:current\s+branch|on\s+branch|branch)\s*[:=]?\s+`?([\w./-]{1,100})" + _END_OF_FIELD
)
_USER_AT_HOST = re.compile(r"(?<![\w.@-])([a-z_][\w-]{0,31})@([A-Za-z0-9][\w-]*(?:\.[\w-]+)*)(?=[:\s]|$)")
_GIT_CUE_LINES = 2  # a commit list's hashes sit below the line that names it
_TRAILING = ".,;:"  # punctuation a path regex takes that ends the sentence instead
MAX_VALUE_CHARS = 56  # of a value shown in a break's description


@dataclass(frozen=True)
class EnvValue:
    """A per-instance environment value: what it is and its span [start, end) in characters."""

    kind: ClassVar[str] = "per_instance_env"  # the cause a break at it has
    what: str  # "working directory", "path", "git hash", "git branch", "user name" or "host name"
    start: int
    end: int
    cued: bool  # its line says what it is


def line_values(line: str, above: str = "") -> list[EnvValue]:
    """The environment values of one line (spans in `line`); `above` is the text of the lines before it,
    where a commit list's heading stands."""
    found: list[EnvValue] = []

    def add(what: str, start: int, end: int, cued: bool) -> None:
        if not any(v.start < end and start < v.end for v in found):
            found.append(EnvValue(what, start, end, cued))

    for match in _USER_AT_HOST.finditer(line):
        add("user name", match.start(1), match.end(1), True)
        add("host name", match.start(2), match.end(2), True)
    for pattern, what in ((_USER, "user name"), (_HOST, "host name")):
        for match in pattern.finditer(line):
            add(what, match.start(1), match.end(1), True)
    for match in _PATH.finditer(line):
        value = match.group().rstrip(_TRAILING)
        cued = _WORKING_DIRECTORY.search(line, 0, match.start()) is not None
        if len(value) > 1 and (cued or value.rstrip("/").count("/") + value.count("\\") >= 2):
            add("working directory" if cued else "path", match.start(), match.start() + len(value), cued)
    for match in _GIT_BRANCH.finditer(line):
        add("git branch", match.start(1), match.end(1), True)
    cue_lines = "\n".join([*above.split("\n")[-_GIT_CUE_LINES:], line])
    if _GIT_CUE.search(cue_lines):
        for match in _GIT_HASH.finditer(line):
            add("git hash", match.start(), match.end(), True)
    return sorted(found, key=lambda v: v.start)


def env_at(text: str, pos: int) -> EnvValue | None:
    """The environment value of `text` covering character `pos`, if any (spans in `text`)."""
    if not 0 <= pos < len(text):
        return None
    line_start = text.rfind("\n", 0, pos) + 1
    line_end = text.find("\n", pos)
    line = text[line_start : line_end if line_end >= 0 else len(text)]
    above_start = line_start
    for _ in range(_GIT_CUE_LINES):
        above_start = text.rfind("\n", 0, max(0, above_start - 1)) + 1
    above = text[above_start : max(above_start, line_start - 1)]
    for value in line_values(line, above):
        if value.start <= pos - line_start < value.end:
            return EnvValue(value.what, value.start + line_start, value.end + line_start, value.cued)
    return None


class EnvScanner:
    """Every environment value of a text, line by line, each distinct (line, lines above) scanned once."""

    def __init__(self) -> None:
        self._lines: dict[tuple[str, str], list[EnvValue]] = {}

    def spans(self, text: str) -> list[EnvValue]:
        """The text's environment values, in order (none spans a line break)."""
        found, at = [], 0
        lines = text.split("\n")
        for i, line in enumerate(lines):
            above = "\n".join(lines[max(0, i - _GIT_CUE_LINES) : i])
            key = (line, above if _GIT_HASH.search(line) else "")
            values = self._lines.get(key)
            if values is None:
                values = self._lines[key] = line_values(line, key[1])
            found += [EnvValue(v.what, v.start + at, v.end + at, v.cued) for v in values]
            at += len(line) + 1
        return found


def describe(text: str, value: EnvValue) -> str:
    """What the value is and the value, e.g. `working directory /tmp/ws-b`; a long path keeps its ends."""
    return f"{value.what} {shorten(text[value.start : value.end])}"


def shorten(value: str, limit: int = MAX_VALUE_CHARS) -> str:
    """`value` within `limit` characters: a path keeps its first part and as many last parts as fit."""
    if len(value) <= limit:
        return value
    sep = "\\" if "\\" in value and "/" not in value else "/"
    parts = value.split(sep)
    head = sep.join(parts[:2]) + sep + "\u2026"
    tail: list[str] = []
    for part in reversed(parts[2:]):
        if len(head) + len(sep.join([part, *tail])) + 1 > limit:
            break
        tail.insert(0, part)
    if not tail:
        return value[: limit - 1] + "\u2026"
    return head + sep + sep.join(tail)
