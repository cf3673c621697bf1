"""`export-mla --refit-rates A,B,...`: one file serving several rates, each with its own refitted o_proj.

The closed-form o_proj refit (mla_refit.py) is fitted to the latent widths it saw: refitted for one rate it serves
that rate alone, and one refit shared by several rates helps none of them as much (docs/refit.md measured that on the
per-head form). Here every served rate is refitted on its own: the layers are cut to that rate's widths (a prefix of
the exported ones, method/mla.truncate_latent, exactly the form computed at that width) and refitted there, layer by
layer. The widest rate's o_proj goes into the stock weights, every narrower rate's into a side file that
`kvrewrite.load(dir, rate=p)` reads at load time (runtime/mla/rate_projections.py): the model it runs is the
single-rate refitted export of that rate, and decode costs nothing more. What it costs: one refit per rate at compile
time and one o_proj per narrower rate on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.compile.mla_refit import MLARefitResult, refit_mla_output
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.method.mla import MLALayer, truncate_latent
from kvrewrite.spec import rate_key


@dataclass(frozen=True)
class RateRefitSettings:
    rates: tuple[float, ...]  # sorted; the first is the export's own (widest) rate
    method: str  # the --refit choice: output or output-local
    tokens: int | None = None  # calibration tokens the least squares read (None: the plan's refit_tokens)

    def __post_init__(self) -> None:
        if self.method not in ("output", "output-local"):
            raise InvalidArgumentError(f"--refit-rates refits with --refit output or output-local, got {self.method!r}")
        if self.tokens is not None and self.tokens < 1:
            raise InvalidArgumentError(f"--refit-tokens must be a positive number of tokens, got {self.tokens}")


@dataclass(frozen=True)
class RateRefitResult:
    layers: list[MLALayer]  # the form at the exported (widest rate's) widths, with that rate's refitted o_proj
    rate_table: dict[str, list[int]]  # every served rate -> per-layer latent widths (prefixes of `layers`')
    rate_o_proj: dict[str, list[torch.Tensor]]  # every narrower rate -> per-layer refitted o_proj (float64)
    # per layer, the largest attention input ||x||^2 over the original and every rate's refitted form: the latent-norm
    # bound then holds at every rate (a narrower latent is a prefix of the widest one, its mean square no larger)
    max_square_norms: list[float]
    refits: dict[str, MLARefitResult]  # per rate

    def provenance(self) -> dict:
        first = next(iter(self.refits.values()))
        return {"method": first.method, "target": first.provenance()["target"], "tokens": first.tokens,
                "ridge": first.ridge, "rates": {key: {k: v for k, v in refit.provenance().items()
                                                       if k.startswith("layer_relative_error")}
                                                 for key, refit in self.refits.items()}}


def parse_refit_rates(text: str, option: str = "--refit-rates") -> tuple[float, ...]:
    """'0.3,0.5,0.7' -> (0.3, 0.5, 0.7): distinct rates in [0, 1), sorted, at least two."""
    try:
        rates = tuple(sorted({round(float(r), 4) for r in text.split(",")}))
    except ValueError:
        raise InvalidArgumentError(f"{option} takes rates A,B,... (e.g. 0.3,0.5,0.7), got {text!r}") from None
    if len(rates) < 2 or not all(0 <= r < 1 for r in rates):
        raise InvalidArgumentError(f"{option} takes at least two distinct rates in [0, 1), got {text!r}")
    return rates


def uniform_rate_widths(rates: tuple[float, ...], values_per_token: int, rope_dim: int, exported_rank: int,
                        layers: int) -> dict[str, list[int]]:
    """Every layer at one latent width per rate: (1 - p) * values_per_token - rope_dim, each within the exported width
    (the widest rate's), so every rate is a prefix of the exported widths."""
    table = {}
    for rate in rates:
        width = round((1 - rate) * values_per_token) - rope_dim
        if not 1 <= width <= exported_rank:
            raise InvalidArgumentError(f"rate {rate:g} leaves a latent of {width} per layer, outside 1..{exported_rank} "
                                       f"(the export's); choose rates that keep more than the {rope_dim} RoPE values")
        table[rate_key(rate)] = [width] * layers
    return table


def refit_mla_at_rates(prepared, layers: list[MLALayer], rate_table: dict[str, list[int]], method: str, tokens: int,
                       ridge: float, progress: bool = False) -> RateRefitResult:
    """The MLA form `layers` (the exported widths) with o_proj refitted at every rate of `rate_table` on its own; the
    table's widest rate must be the exported widths."""
    exported = [layer.kv_lora_rank for layer in layers]
    widest = [key for key, widths in rate_table.items() if list(widths) == exported]
    if not widest:
        raise InvalidArgumentError("the widest refitted rate must be the exported widths (export at --kv-share 1 - A)")
    refits, rate_o_proj, norms = {}, {}, None
    for key, widths in sorted(rate_table.items()):
        narrowed = [truncate_latent(layer, width) for layer, width in zip(layers, widths)]
        refit = refit_mla_output(prepared, narrowed, method, tokens, ridge, progress)
        refits[key] = refit
        norms = refit.max_square_norms if norms is None else [max(a, b) for a, b in zip(norms, refit.max_square_norms)]
        if key != widest[0]:
            rate_o_proj[key] = [layer.o_proj for layer in refit.layers]
    return RateRefitResult(refits[widest[0]].layers, dict(rate_table), rate_o_proj, norms, refits)
