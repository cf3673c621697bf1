"""`export-mla --refit-rates A,B,...`: one file serving several rates, each with its own refitted o_proj.

The closed-form o_proj refit (refit.py) is fitted to the latent widths it saw: refitted for one rate it serves
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

from kvrewrite.compile.mla.allocation import latent_width_at_rate
from kvrewrite.compile.mla.export import PreparedSource
from kvrewrite.compile.mla.plan import check_refit_rates
from kvrewrite.compile.mla.refit import REFIT_TARGETS, MLARefitResult, refit_mla_output
from kvrewrite.compile.on_device import whole_model_on
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.method.mla import MLALayer, truncate_latent
from kvrewrite.spec import rate_key


@dataclass(frozen=True)
class RateRefitResult:
    refits: dict[str, MLARefitResult]  # per served rate: the form at its widths with its refitted o_proj
    widest: str  # the rate key of the exported widths, whose o_proj the stock weights hold
    rate_table: dict[str, list[int]]  # every served rate -> per-layer latent widths (prefixes of the exported ones)
    # per layer, the largest attention input ||x||^2 over the original and every rate's refitted form: the latent-norm
    # bound then holds at every rate (a narrower latent is a prefix of the widest one, its mean square no larger)
    max_square_norms: list[float]

    @property
    def layers(self) -> list[MLALayer]:
        """The form at the exported widths, with the widest rate's refitted o_proj."""
        return self.refits[self.widest].layers

    @property
    def rate_o_proj(self) -> dict[str, list[torch.Tensor]]:
        """Every narrower rate -> its per-layer refitted o_proj (float64), for the side file."""
        return {
            key: [layer.o_proj for layer in refit.layers] for key, refit in self.refits.items() if key != self.widest
        }

    def provenance(self) -> dict:
        first = self.refits[self.widest]
        return {
            "method": first.method,
            "target": REFIT_TARGETS[first.method],
            "tokens": first.tokens,
            "ridge": first.ridge,
            "rates": {
                key: {k: v for k, v in refit.provenance().items() if k.startswith("layer_relative_error")}
                for key, refit in self.refits.items()
            },
        }


def parse_refit_rates(text: str, option: str = "`refit_rates`") -> tuple[float, ...]:
    """'0.3,0.5,0.7' -> (0.3, 0.5, 0.7): distinct rates in [0, 1) in hundredths (the rate table's keys), sorted, at
    least two."""
    try:
        given = [float(r) for r in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"{option} takes rates A,B,... (e.g. 0.3,0.5,0.7), got {text!r}") from None
    return check_refit_rates(given, option, shown=text)


def uniform_rate_widths(
    rates: tuple[float, ...], values_per_token: int, rope_dim: int, exported_rank: int, layers: int
) -> dict[str, list[int]]:
    """Every layer at one latent width per rate: the exported width for the widest (first) rate, (1 - p) *
    values_per_token - rope_dim for the others, each within the exported width, so every rate is a prefix of it."""
    table = {}
    for rate in rates:
        width = exported_rank if rate == rates[0] else latent_width_at_rate(rate, values_per_token, rope_dim)
        if not 1 <= width <= exported_rank:
            raise InvalidArgumentError(
                f"rate {rate:g} leaves a latent of {width} per layer, outside 1..{exported_rank} "
                f"(the export's); choose rates that keep more than the {rope_dim} RoPE values"
            )
        table[rate_key(rate)] = [width] * layers
    return table


def served_refit_table(rates: tuple[float, ...], served: dict[str, list[int]]) -> dict[str, list[int]]:
    """The named rates' rows of an allocated or nested export's rate table: the refitted file serves those alone (a
    table rate without its own o_proj would run another rate's)."""
    missing = [rate_key(r) for r in rates if rate_key(r) not in served]
    if missing:
        raise InvalidArgumentError(
            f"`refit_rates` {', '.join(missing)} are not in the export's rate table ({', '.join(served)})"
        )
    return {rate_key(r): served[rate_key(r)] for r in rates}


def refit_mla_at_rates(
    prepared: PreparedSource,
    layers: list[MLALayer],
    rate_table: dict[str, list[int]],
    method: str,
    tokens: int,
    ridge: float,
    progress: bool = False,
) -> RateRefitResult:
    """The MLA form `layers` (the exported widths) with o_proj refitted at every rate of `rate_table` on its own; the
    table's widest rate must be the exported widths."""
    exported = [layer.kv_lora_rank for layer in layers]
    widest = [key for key, widths in rate_table.items() if list(widths) == exported]
    if not widest:
        raise InvalidArgumentError("the widest refitted rate must be the exported widths (export at `kv_share` 1 - A)")
    with whole_model_on(prepared.ctx.original_model(), prepared.ctx.plan.device):  # one move for every rate's refit
        refits = {
            key: refit_mla_output(
                prepared,
                [truncate_latent(layer, width) for layer, width in zip(layers, widths)],
                method,
                tokens,
                ridge,
                progress,
            )
            for key, widths in sorted(rate_table.items())
        }
    norms = [max(per_rate) for per_rate in zip(*(refit.max_square_norms for refit in refits.values()))]
    return RateRefitResult(refits, widest[0], dict(rate_table), norms)


def rates_match_maths(
    prepared: PreparedSource, rated: RateRefitResult, output, tokens: torch.Tensor
) -> dict[str, float]:
    """Per narrower rate: max |Δlogit| between the export loaded by kvrewrite.load(output, rate=p) (float32) and our
    maths at that rate's widths with its refitted o_proj (the check export_matches_maths makes of the widest)."""
    from kvrewrite.compile.mla.form import mla_reference_model
    from kvrewrite.runtime.load import load

    device = prepared.ctx.plan.device
    tokens = tokens.to(device)
    diffs = {}
    for key in rated.rate_o_proj:
        model = load(output, rate=float(key), dtype=torch.float32).eval()
        with torch.no_grad():
            with whole_model_on(prepared.ctx.original_model(), device) as original:
                ours = mla_reference_model(original, rated.refits[key].layers)(tokens).logits
            diffs[key] = float((model.to(device)(tokens).logits - ours).abs().max())
    return diffs
