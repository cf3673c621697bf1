"""A pass: one step of the compiler, with a name and a one-line description for `--dry-run`."""

from __future__ import annotations

from typing import Protocol

from kvrewrite.compile.passes.context import CompileContext


class Pass(Protocol):
    name: str
    description: str

    def run(self, ctx: CompileContext) -> None: ...
