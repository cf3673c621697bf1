"""A pass: one step of the compiler, with a name, a one-line description for `--dry-run`, and the results it returns.

The contract: `run(ctx)` reads the (frozen) context and returns a mapping of results, never assigns to it. Every key
is a CompileContext field or `report.<section>` (a section of compress_report.json), and must be declared: in
`produces` (the pass is the first to set it) or in `refines` (the pass replaces what an earlier pass set; the few
real refinements say why next to their declaration). `run_pass` applies the results and refuses anything else, so
which pass sets which field is read from the declarations, not from the code.

The same `run_pass` runs the MLA export's passes over their own frozen context (compile/mla/passes/context.py): a
context type may name, in a `pipeline_fields` class attribute, the fields only its builder sets (default: the compile
context's PIPELINE_FIELDS); every other field is a result some pass declares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import cache
from typing import Any, Protocol, TypeVar

from kvrewrite.compile.passes.context import PIPELINE_FIELDS, CompileContext

REPORT_PREFIX = "report."
Context = TypeVar("Context")


@cache
def context_fields(context_type: type) -> frozenset[str]:
    """The fields of a frozen context type a pass may declare: all but those only the pipeline sets."""
    fixed = getattr(context_type, "pipeline_fields", PIPELINE_FIELDS)
    return frozenset(f.name for f in dataclasses.fields(context_type)) - set(fixed)


CONTEXT_FIELDS = context_fields(CompileContext)


class Pass(Protocol):
    name: str
    description: str
    produces: tuple[str, ...]
    # optional: fields (or report sections) an earlier pass set that this one replaces
    refines: tuple[str, ...]

    def run(self, ctx: CompileContext) -> Mapping[str, Any]: ...


class PassContractError(RuntimeError):
    """A pass broke the results contract (a bug in the pass, not in the user's input)."""


def run_pass(ctx: Context, step: Pass) -> Context:
    """The context after `step`: its results applied with dataclasses.replace, report sections merged."""
    results = step.run(ctx)
    allowed = context_fields(type(ctx))
    if not isinstance(results, Mapping):
        raise PassContractError(f"pass {step.name} returned {type(results).__name__}, not a mapping of its results")
    produces, refines = tuple(getattr(step, "produces", ())), tuple(getattr(step, "refines", ()))
    for key in produces + refines:
        if key not in allowed and not (key.startswith(REPORT_PREFIX) and len(key) > len(REPORT_PREFIX)):
            raise PassContractError(
                f"pass {step.name} declares {key!r}, which is neither a context field nor report.<section>"
            )
    provenance = dict(ctx.provenance)
    fields, sections = {}, {}
    for key, value in results.items():
        if key not in produces and key not in refines:
            raise PassContractError(
                f"pass {step.name} returned {key!r}, which it does not declare (produces {produces}, refines {refines})"
            )
        earlier = provenance.get(key)
        if key in produces and earlier is not None:
            raise PassContractError(
                f"pass {step.name} sets {key!r}, already set by pass {earlier}; only a pass that declares it "
                "in `refines` may replace it"
            )
        if key in refines and earlier is None:
            raise PassContractError(f"pass {step.name} refines {key!r}, which no earlier pass set")
        provenance[key] = step.name if earlier is None else f"{earlier} > {step.name}"
        if key.startswith(REPORT_PREFIX):
            sections[key[len(REPORT_PREFIX) :]] = value
        else:
            fields[key] = value
    if sections:
        fields["report"] = {**ctx.report, **sections}
    return dataclasses.replace(ctx, **fields, provenance=provenance)
