"""The one exception type users see.

Every problem a user can fix (a bad recipe, bad data, a bad path) is raised as
a ``UserError``. The CLI prints it as one paragraph and exits non-zero; it
never shows a traceback for these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Problem:
    """One thing wrong: where, what, and how to fix it."""

    where: str  # dotted recipe key, "file:line", or a path
    what: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        return f"{text}. {self.fix}" if self.fix else text


class UserError(Exception):
    """An error the user can fix. Carries one or more ``Problem`` s."""

    exit_code = 2

    def __init__(self, *problems: Problem | str, title: str = "") -> None:
        self.problems = [p if isinstance(p, Problem) else Problem("", p) for p in problems]
        self.title = title
        super().__init__(self.render())

    def render(self) -> str:
        lines = [str(p) for p in self.problems]
        if len(lines) == 1 and not self.title:
            return lines[0]
        head = self.title or f"{len(lines)} problems"
        return head + ":\n" + "\n".join(f"  - {line}" for line in lines)


class TrainingDiverged(UserError):
    """The loss became NaN or inf."""

    exit_code = 3
