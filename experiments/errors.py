"""What a command reports when the user asked for something it cannot do: every problem at once, under a
heading that says which command refused. The CLI prints it and exits 2; nothing has run or been recorded."""
from __future__ import annotations


class UserError(Exception):
    heading = "error"

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{self.heading}:\n" + "\n".join(f"  - {p}" for p in problems))
