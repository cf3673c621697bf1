"""Layer groups and g_l by depth on SmolLM2 (ZDC §5.2), measured with the ORIGINAL model's attention.

    python benchmarks/layer_groups.py [--calib-windows 4] [--heldout-windows 4] [--length 1024] [--window 64] \
        [--pool 64] [--share 0.25] [--checkpoint DIR]

For every layer (benchmarks/attention_evidence.py's record_attention_evidence, one eager forward per window):
1. each token's importance under two scores: `attention` (attention received, mean over the queries that read it,
   summed over heads) and `denominator` (ZDC's: sum over heads of the token's own softmax denominator as a query);
2. the important-token set at share g: the top g of the scored tokens, per pool of `pool` tokens (as
   kvrewrite.runtime.tiers classifies) and globally. Scored tokens are those beyond the recent window that at least one
   pool's worth of later queries read beyond the window (the first (T - W - pool) rounded down to whole pools);
3. the repetition ratio |S_i ∩ S_j| / |S_i| between layers, for the important sets and for their complements (the
   unimportant sets), pooled over windows; layer groups found on the CALIBRATION windows by ZDC's offline rule
   (contiguous layers whose important AND unimportant sets repeat those of the group's first layer at >= a
   threshold; ZDC uses 95%), and each group's mean ratio to its first layer on calibration and HELD-OUT windows;
4. g_l by depth: per layer, the smallest share of the scored tokens that holds a fraction (e.g. 90%) of the aged
   attention mass (attention from queries that read the token beyond the window, as a mean per such query),
   per pool and globally; a recommended g_l per layer (the per-pool 90% shares on calibration text, scaled to a
   mean share), and the least-squares line through them (does g_l grow with depth?).

With --checkpoint (a compressed checkpoint of the same model), it also reports the held-out continuation Δppl of
one token-adaptive recipe with the recommended ramp against a uniform g at the same mean share, with the chunked
protocol of benchmarks/recent_window.py (kvrewrite.publish.evaluation.continuation_nll).

Writes benchmarks/results/layer_groups.json (command, commit, machine, date, settings) and layer_groups.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention_evidence import (  # noqa: E402
    greedy_layer_groups,
    group_ratio,
    important_mask,
    linear_ramp,
    mass_share,
    record_attention_evidence,
    repetition_matrix,
    scale_to_mean,
)

from kvrewrite.io.calibration_data import calibration_token_sequences, evaluation_token_sequences  # noqa: E402
from kvrewrite.io.source_model import load_fp32_model  # noqa: E402
from kvrewrite.io.sources import resolve_model_source  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCORES = ("attention", "denominator")
MODES = ("pool", "global")


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=root
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def evidence_for(model, windows: torch.Tensor, window: int, n_scored: int) -> dict[str, torch.Tensor]:
    """Per window: scores and aged mass of the scored tokens, tensors [n_windows, L, n_scored]."""
    out = {"attention": [], "denominator": [], "mass": []}
    for i, ids in enumerate(windows):
        t0 = time.perf_counter()
        ev = record_attention_evidence(model, ids[None], window)
        out["attention"].append(ev.mean_received()[:, 0, :n_scored])
        out["denominator"].append(ev.log_denominator[:, 0, :n_scored])
        out["mass"].append(ev.mean_aged_received()[:, 0, :n_scored])
        print(f"  window {i + 1}/{len(windows)}: {time.perf_counter() - t0:.1f}s", flush=True)
    return {k: torch.stack(v) for k, v in out.items()}


def r4(x) -> float | None:
    return None if x is None else round(float(x), 4)


def matrix(m: torch.Tensor) -> list[list[float]]:
    return [[r4(v) for v in row] for row in m]


def set_analysis(
    calib: torch.Tensor, held: torch.Tensor, share: float, pool: int | None, thresholds: list[float]
) -> dict:
    """Repetition matrices, adjacent ratios and groups for one score and one mode (scores [n, L, N])."""
    rep = {}
    for name, scores in (("calibration", calib), ("heldout", held)):
        imp = important_mask(scores, share, pool)
        rep[name] = {"important": repetition_matrix(imp), "unimportant": repetition_matrix(~imp)}
    n_layers = calib.shape[1]
    adjacent = [
        {
            "layers": [i, i + 1],
            **{
                f"{text}_{kind}": r4(rep[text][kind][i, i + 1]) for text in rep for kind in ("important", "unimportant")
            },
        }
        for i in range(n_layers - 1)
    ]
    groups = {}
    for tau in thresholds:
        found = greedy_layer_groups([rep["calibration"]["important"], rep["calibration"]["unimportant"]], tau)
        groups[str(tau)] = [
            {
                "layers": g,
                **{
                    f"{text}_{kind}": r4(group_ratio(rep[text][kind], g))
                    for text in rep
                    for kind in ("important", "unimportant")
                },
            }
            for g in found
        ]
    return {
        "repetition_important_calibration": matrix(rep["calibration"]["important"]),
        "repetition_important_heldout": matrix(rep["heldout"]["important"]),
        "repetition_unimportant_calibration": matrix(rep["calibration"]["unimportant"]),
        "repetition_unimportant_heldout": matrix(rep["heldout"]["unimportant"]),
        "adjacent": adjacent,
        "mean_adjacent_important": {t: r4(sum(a[f"{t}_important"] for a in adjacent) / len(adjacent)) for t in rep},
        "groups": groups,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = result["settings"]["share"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1, 1, 1.25]})
    for ax, score in zip(axes[:2], SCORES):
        m = result["sets"][score]["pool"]["repetition_important_calibration"]
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", origin="upper")
        ax.set_title(
            f"repetition |S_i ∩ S_j| / |S_i|, score '{score}'\n(top {share:g} per {result['settings']['pool']}-token pool, calibration)",
            fontsize=9,
        )
        ax.set_xlabel("layer j")
        ax.set_ylabel("layer i")
        fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[2]
    layers = list(range(result["model"]["layers"]))
    g = result["g_by_depth"]
    main = str(result["settings"]["mass_fraction"])
    ax.plot(
        layers, g["pool"][main]["calibration"], "o-", label=f"per pool, {float(main):.0%} of aged mass (calibration)"
    )
    ax.plot(layers, g["pool"][main]["heldout"], "o--", label="per pool (held-out)", alpha=0.7)
    ax.plot(layers, g["global"][main]["calibration"], "s-", label=f"global, {float(main):.0%} (calibration)")
    ax.plot(layers, g["global"][main]["heldout"], "s--", label="global (held-out)", alpha=0.7)
    rec = result["recommended_ramp"]
    ax.plot(layers, rec["ramp"], "k-", lw=2, label=f"recommended g_l (per-pool profile, mean {rec['mean']:g})")
    ax.plot(layers, rec["linear_fit"], "k:", lw=1.5, label="linear fit, same mean")
    ax.set_xlabel("layer")
    ax.set_ylabel("g_l: share of scored tokens")
    ax.set_ylim(0, 1)
    ax.set_title("g_l by depth: smallest share of tokens holding the aged attention mass", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(
        f"SmolLM2-135M layer groups and g_l by depth ({result['settings']['calib_windows']} calibration + "
        f"{result['settings']['heldout_windows']} held-out windows of {result['settings']['length']} tokens, W={result['settings']['window']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def delta_ppl(args, ramp: list[float], line: list[float], config, tokenizer) -> dict:
    """Held-out continuation Δppl: recipe with the recommended g_l (and the linear fit) vs uniform g at the same
    mean share."""
    from transformers import DynamicCache

    import kvrewrite
    from kvrewrite.publish.evaluation import continuation_nll, kv_cache_bytes_per_token_formula

    windows = evaluation_token_sequences(tokenizer, args.heldout_windows * args.length, args.length)
    original = load_fp32_model(resolve_model_source(args.baseline).path).eval()
    nll, n, _ = continuation_nll(original, windows, args.context, lambda: DynamicCache(config=config))
    base = math.exp(nll / n)
    print(f"original: ppl {base:.3f}", flush=True)
    mean = sum(ramp) / len(ramp)
    rows = {"original": {"ppl": base}}
    for name, share in (("uniform", mean), ("ramp", ramp), ("linear_fit", line)):
        important = {"rate": args.important_rate, "share": share, "score": "attention", "pool": args.pool}
        model = kvrewrite.load(
            args.checkpoint, rate=args.aged_rate, recent_window=args.window, important=important
        ).eval()
        t0 = time.perf_counter()
        nll, n, held = continuation_nll(model, windows, args.context, model.make_kv_cache, chunk=64)
        ppl = math.exp(nll / n)
        rows[name] = {
            "share": share if isinstance(share, float) else [round(g, 4) for g in share],
            "ppl": ppl,
            "delta_ppl": ppl / base - 1,
            "bytes_per_token": held,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"{name}: ppl {ppl:.3f}  Δ {100 * (ppl / base - 1):+.2f}%  {held:.0f} B/token", flush=True)
    fp16 = kv_cache_bytes_per_token_formula(config, torch.float16)
    for row in rows.values():
        if "bytes_per_token" in row:
            row["fp16_share"] = row["bytes_per_token"] / fp16
    return {
        "checkpoint": args.checkpoint,
        "protocol": {
            "windows": args.heldout_windows,
            "length": args.length,
            "context": args.context,
            "chunk": 64,
            "text": "held-out wiki",
        },
        "recipe": {
            "aged_rate": args.aged_rate,
            "recent_window": args.window,
            "important_rate": args.important_rate,
            "score": "attention",
            "pool": args.pool,
        },
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="smollm2-135m")
    parser.add_argument("--calib-windows", type=int, default=4)
    parser.add_argument("--heldout-windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--window", type=int, default=64, help="recent window W")
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--share", type=float, default=0.25, help="important share g for the token sets")
    parser.add_argument("--thresholds", default="0.95,0.9,0.85,0.8,0.7,0.6,0.5")
    parser.add_argument("--mass", default="0.8,0.9,0.95", help="mass fractions for g_l by depth")
    parser.add_argument("--mass-fraction", type=float, default=0.9, help="the fraction the recommended ramp uses")
    parser.add_argument("--ramp-mean", type=float, default=0.25, help="mean share of the recommended ramp")
    parser.add_argument("--checkpoint", help="compressed checkpoint: also measure Δppl of ramp vs uniform g")
    parser.add_argument("--aged-rate", type=float, default=0.7)
    parser.add_argument("--important-rate", type=float, default=0.3)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "layer_groups.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    fractions = [float(f) for f in args.mass.split(",")]
    if args.mass_fraction not in fractions:
        fractions.append(args.mass_fraction)
    n_scored = (args.length - args.window - args.pool) // args.pool * args.pool
    if n_scored < args.pool:
        raise SystemExit("--length too short for the window and one pool")

    t_start = time.perf_counter()
    source = resolve_model_source(args.baseline)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    model = load_fp32_model(source.path).eval()
    config = model.config
    calib = calibration_token_sequences("wiki", tokenizer, args.calib_windows * args.length, args.length, seed=0)
    held = evaluation_token_sequences(tokenizer, args.heldout_windows * args.length, args.length)
    print(f"calibration windows ({args.calib_windows} x {args.length}):", flush=True)
    ev_c = evidence_for(model, calib, args.window, n_scored)
    print(f"held-out windows ({args.heldout_windows} x {args.length}):", flush=True)
    ev_h = evidence_for(model, held, args.window, n_scored)
    del model

    sets = {
        score: {
            mode: set_analysis(ev_c[score], ev_h[score], args.share, args.pool if mode == "pool" else None, thresholds)
            for mode in MODES
        }
        for score in SCORES
    }
    # How often the two scores pick the same tokens, per layer (per-pool sets).
    agreement = {}
    for text, ev in (("calibration", ev_c), ("heldout", ev_h)):
        a = important_mask(ev["attention"], args.share, args.pool)
        d = important_mask(ev["denominator"], args.share, args.pool)
        agreement[text] = [r4((a[:, i] & d[:, i]).sum() / a[:, i].sum().clamp(min=1)) for i in range(a.shape[1])]

    g_by_depth = {
        mode: {
            str(f): {
                text: [r4(v) for v in mass_share(ev["mass"], f, args.pool if mode == "pool" else None).mean(dim=0)]
                for text, ev in (("calibration", ev_c), ("heldout", ev_h))
            }
            for f in fractions
        }
        for mode in MODES
    }
    profile = g_by_depth["pool"][str(args.mass_fraction)]["calibration"]
    line = linear_ramp(profile, args.ramp_mean, low=0.0, high=1.0)
    ramp = scale_to_mean(profile, args.ramp_mean, low=0.0, high=1.0)
    x = list(range(len(profile)))
    slope = sum((a - sum(x) / len(x)) * (b - sum(profile) / len(profile)) for a, b in zip(x, profile)) / sum(
        (a - sum(x) / len(x)) ** 2 for a in x
    )
    result = {
        "command": "python " + " ".join(sys.argv),
        "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": {
            "source": args.baseline,
            "path": str(source.path),
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "attention": "eager (benchmarks/attention_evidence.py), float32 weights",
        },
        "settings": {
            "calib_windows": args.calib_windows,
            "heldout_windows": args.heldout_windows,
            "length": args.length,
            "window": args.window,
            "pool": args.pool,
            "share": args.share,
            "scored_tokens": n_scored,
            "thresholds": thresholds,
            "mass_fractions": fractions,
            "mass_fraction": args.mass_fraction,
            "ramp_mean": args.ramp_mean,
            "calibration_text": "wiki calibration split (calibration_token_sequences('wiki', seed=0))",
            "heldout_text": "held-out wiki (evaluation_token_sequences)",
        },
        "definitions": {
            "attention": "attention received, summed over heads, mean over the queries t >= j that read it",
            "denominator": "ZDC §5.2: sum over heads h of sum_{k<=t} exp(s_k^h), the token's own softmax denominator "
            "as a query (ranked by its log)",
            "scored_tokens": "positions 0..N-1 with N = floor((length - W - pool) / pool) * pool: beyond the window and "
            "read beyond it by at least `pool` queries",
            "sets": "important = top `share` of the scored tokens per pool (mode 'pool') or over all (mode 'global'); "
            "unimportant = the rest",
            "repetition": "R[i][j] = |S_i ∩ S_j| / |S_i|, pooled over windows",
            "groups": "contiguous; layer j joins the current group while the important and unimportant repetition "
            "ratios to the group's first layer on CALIBRATION text are >= the threshold (ZDC: 95%); "
            "each group's ratios are the mean ratio of its later layers to its first layer",
            "g_by_depth": "smallest share of scored tokens holding the fraction of the aged mass (attention from queries "
            "t - j > W, mean per such query, summed over heads), per pool averaged over pools, or global; "
            "mean over windows",
            "recommended_ramp": "g_by_depth.pool[mass_fraction].calibration per layer, scaled to mean `ramp_mean` "
            "and clipped to [0, 1] ('ramp'); 'linear_fit' is the least-squares line through the "
            "same values, scaled the same way",
            "chance": "repetition ratio of random sets of the same sizes: share for important, 1 - share for unimportant",
        },
        "sets": sets,
        "score_agreement_per_layer": agreement,
        "g_by_depth": g_by_depth,
        "chance": {"important": args.share, "unimportant": 1 - args.share},
        "recommended_ramp": {
            "from": f"pool, {args.mass_fraction} of aged mass, calibration",
            "slope_per_layer": r4(slope),
            "mean": args.ramp_mean,
            "ramp": [r4(g) for g in ramp],
            "linear_fit": [r4(g) for g in line],
        },
    }
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {result['seconds']:.0f}s")
    for score in SCORES:
        s = sets[score]["pool"]
        print(f"[{score}] mean adjacent important repetition: {s['mean_adjacent_important']}")
        for tau, groups in s["groups"].items():
            multi = [
                (g["layers"][0], g["layers"][-1], g["calibration_important"], g["heldout_important"])
                for g in groups
                if len(g["layers"]) > 1
            ]
            print(f"  threshold {tau}: {len(groups)} groups; multi-layer (first, last, calib, held-out): {multi}")
    print("g_l (pool, 0.9, calibration):", profile)
    print("ramp:", result["recommended_ramp"]["ramp"])
    print(
        "linear fit:", result["recommended_ramp"]["linear_fit"], "slope", result["recommended_ramp"]["slope_per_layer"]
    )
    if args.checkpoint:  # the measurement is already written; add the Δppl extra to it
        result["delta_ppl"] = delta_ppl(args, ramp, line, config, tokenizer)
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"added delta_ppl to {args.out} ({result['seconds']:.0f}s in all)")


if __name__ == "__main__":
    main()
