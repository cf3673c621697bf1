"""vLLM serves kvrewrite's MLA export: a Llama-3-8B-shaped model (random weights, nothing downloaded) against its
export at kv_lora_rank 512 + qk_rope_head_dim 64, the cached width vLLM's MLA kernels take. NOT RUN in the session
that wrote it (no GPU was lent); README.md in this folder says how to run it.

    python benchmarks/vllm_mla/run.py all --work /data/vllm_mla          # build, measure both, check, write JSON

Steps (each also a sub-command, so a failed step can be re-run alone):
- build: on CPU (or CUDA if present), from configs only:
  * `original`: LlamaForCausalLM at Llama-3-8B's shapes (hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim
    128, MLP 14336, vocabulary 128256, rope_theta 500000), random weights (q/k sharpened as in tests/tiny_models.py),
    bfloat16, with a word-level tokenizer of the same vocabulary built locally (`w0 ... w128255`);
  * `export`: kvrewrite's MLA export of it at r = 512, d_r = 64 (every second rotary frequency keeps its rotation,
    method/mla.py), calibrated on a text file of random words from that vocabulary (random weights: the statistics'
    content does not matter, the shapes and the export path do), bfloat16;
  * `small` and `small-export`: a 2-layer model (hidden 1024, 8 heads, 4 KV heads, head_dim 128, vocabulary 1024) and
    its export at the same 512 + 64, through the `kvrewrite export-mla` CLI, for the correctness check.
- measure MODEL: one fresh process per model (GPU memory is vLLM's alone): vLLM's stated KV cache capacity (its
  "KV cache size: N tokens" and "Maximum concurrency for L tokens per request: X x" log lines: the most sequences of
  length L that fit), then at fixed concurrency C (max_num_seqs = C, C prompts of --input-len random token ids,
  --output-len tokens each, ignore_eos): output tokens/s, and time per output token = (time of the full generate -
  time of the same prompts with max_tokens=1) / (output_len - 1).
- check: the small export in vLLM (bfloat16) against stock transformers (DeepseekV3ForCausalLM, float32) on the same
  files: per-token log-probabilities of prompt tokens (teacher forcing), and greedy continuations.
Writes benchmarks/results/vllm_mla.json (command, commit, machine, date, vLLM version).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "vllm_mla.json"
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
SMALL = dict(
    LLAMA3_8B,
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
)
KV_LORA_RANK, ROPE_DIM = 512, 64
KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


# ---- build -------------------------------------------------------------------------------------------------------


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def build_source(directory: Path, shape: dict, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").is_file():
        return
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(initializer_range=0.02, **shape)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # random init gives near-uniform attention; sharpen q/k so attention patterns matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(directory)
    word_tokenizer(shape["vocab_size"]).save_pretrained(directory)
    del model


def calibration_file(path: Path, vocab_size: int, words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = [" ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(64)) for _ in range(words // 64 + 1)]
    path.write_text("\n\n".join(lines) + "\n")
    return path


def export_command(source: Path, output: Path, calibration: Path, calib_tokens: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvrewrite.cli.app",
        "export-mla",
        str(source),
        "-o",
        str(output),
        "--kv-lora-rank",
        str(KV_LORA_RANK),
        "--qk-rope-head-dim",
        str(ROPE_DIM),
        "--dtype",
        "bfloat16",
        "--calibration",
        str(calibration),
        "--calib-tokens",
        str(calib_tokens),
        "--verify-tokens",
        "32",
        "--position-free-queries",
        "source",
        "--refit",
        "none",
    ]  # as export_large: random weights, nothing to measure


def export_large(source: Path, output: Path, calibration: Path, calib_tokens: int) -> None:
    """The 8B export through export-mla's own functions (the CLI's verify step would hold three fp32 copies of an 8B
    model in memory); same widths, same code path as `kvrewrite export-mla ... --kv-lora-rank 512 --qk-rope-head-dim 64`."""
    # Not kvrewrite.export_mla: its checks at the end (verify_tokens >= 1) would hold those copies, and MLAPlan has no
    # `device` to run the statistics on the GPU; the parts below are the ones export_mla calls for these widths.
    import torch

    from kvrewrite.compile.mla.export import export_at_share, mla_layers_at_widths, prepare_source
    from kvrewrite.compile.mla.form import widths_for_ranks
    from kvrewrite.compile.plan import Plan

    if (output / "config.json").is_file():
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = Plan(
        model=str(source),
        calibration=str(calibration),
        calib_tokens=calib_tokens,
        device=device,
        dtype="float32",  # the statistics in float32, as export-mla's (compress's default is now the source's)
        progress=True,
    )
    # Serving speed and cache size do not depend on how the position-free queries are scored (only q_proj's
    # values change), and random weights have no attention pattern worth measuring: unrotated.
    prepared = prepare_source(plan, position_free_queries="source")
    widths = widths_for_ranks(prepared.ctx.geometry, KV_LORA_RANK, ROPE_DIM)
    layers = mla_layers_at_widths(prepared, widths)
    export_at_share(prepared, layers, output, dtype=torch.bfloat16)


def build(work: Path, calib_tokens: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    build_source(work / "small", SMALL, seed=1)
    small_calibration = calibration_file(work / "calibration_small.txt", SMALL["vocab_size"], 4 * 2048)
    if not (work / "small-export" / "config.json").is_file():
        subprocess.run(
            export_command(work / "small", work / "small-export", small_calibration, 2048), check=True, cwd=ROOT
        )
    build_source(work / "original", LLAMA3_8B, seed=0)
    calibration = calibration_file(work / "calibration.txt", LLAMA3_8B["vocab_size"], 4 * calib_tokens)
    export_large(work / "original", work / "export", calibration, calib_tokens)


# ---- measure (one model per process) -----------------------------------------------------------------------------


def measure(model: Path, concurrency: int, input_len: int, output_len: int, gpu_memory_utilization: float) -> dict:
    """Runs vLLM on `model` in this process; prints one JSON line."""
    from vllm import LLM, SamplingParams

    max_len = input_len + output_len
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_seqs=concurrency,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=0,
    )
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(input_len)]} for _ in range(concurrency)]
    prefill_only = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
    full = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    llm.generate(prompts, prefill_only)  # warm-up (CUDA graphs, kernels)
    t0 = time.perf_counter()
    llm.generate(prompts, prefill_only)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, full)
    t_full = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "concurrency": concurrency,
        "input_len": input_len,
        "output_len": output_len,
        "generate_s": t_full,
        "prefill_only_s": t_prefill,
        "output_tokens": generated,
        "output_tokens_per_s": generated / t_full,
        "time_per_output_token_ms": 1000 * (t_full - t_prefill) / (output_len - 1),
    }


def measure_in_subprocess(model: Path, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "measure",
        str(model),
        "--concurrency",
        str(args.concurrency),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    log = done.stdout + done.stderr
    (args.work / f"vllm_{model.name}.log").write_text(log)
    if done.returncode:
        raise RuntimeError(f"vLLM on {model} failed (log: {args.work / f'vllm_{model.name}.log'}):\n{log[-3000:]}")
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    tokens, concurrency = KV_TOKENS.search(log), CONCURRENCY.search(log)
    result["kv_cache_tokens"] = int(tokens.group(1).replace(",", "")) if tokens else None
    result["max_concurrency_stated"] = (
        {"tokens_per_request": int(concurrency.group(1).replace(",", "")), "sequences": float(concurrency.group(2))}
        if concurrency
        else None
    )
    result["attention_backend_lines"] = [line for line in log.splitlines() if "backend" in line.lower()][:5]
    return result


# ---- correctness: small export in vLLM against stock transformers -----------------------------------------------


def check(work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    model_dir = work / "small-export"
    rng = random.Random(1)
    prompts = [[rng.randrange(3, SMALL["vocab_size"]) for _ in range(64)] for _ in range(4)]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logprobs = [torch.log_softmax(reference(torch.tensor([p])).logits[0].double(), -1) for p in prompts]
        ref_greedy = [
            reference.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    del reference
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        seed=0,
        gpu_memory_utilization=0.3,
    )
    scored = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=1, detokenize=False),
    )
    worst, agree, total = 0.0, 0, 0
    for prompt, out, ref_lp, ref_gen in zip(prompts, scored, ref_logprobs, ref_greedy):
        for pos in range(1, len(prompt)):  # prompt_logprobs[pos]: {token_id: Logprob} for prompt[pos]
            entry = out.prompt_logprobs[pos][prompt[pos]]
            worst = max(worst, abs(entry.logprob - float(ref_lp[pos - 1, prompt[pos]])))
        gen = list(out.outputs[0].token_ids)
        agree += sum(a == b for a, b in zip(gen, ref_gen))
        total += len(ref_gen)
    return {
        "prompts": len(prompts),
        "prompt_tokens_each": len(prompts[0]),
        "max_abs_prompt_logprob_diff_vllm_bf16_vs_transformers_fp32": worst,
        "greedy_token_agreement_16_new_tokens": agree / total,
    }


# ---- all ---------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["build", "measure", "check", "all"])
    parser.add_argument("model", nargs="?", type=Path, help="measure: the model directory")
    parser.add_argument("--work", type=Path, default=Path("vllm_mla_work"))
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()
    if args.step == "build":
        build(args.work, args.calib_tokens)
    elif args.step == "measure":
        print(
            json.dumps(
                measure(args.model, args.concurrency, args.input_len, args.output_len, args.gpu_memory_utilization)
            )
        )
    elif args.step == "check":
        print(json.dumps(check(args.work), indent=2))
    else:
        started = time.perf_counter()
        build(args.work, args.calib_tokens)
        runs = {name: measure_in_subprocess(args.work / name, args) for name in ("original", "export")}
        correctness = check(args.work)
        import torch
        import vllm

        o, e = runs["original"], runs["export"]
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        document = {
            "command": "python benchmarks/vllm_mla/run.py " + " ".join(sys.argv[1:]),
            "commit": commit,
            "machine": f"{torch.cuda.get_device_name(0)}, {platform.machine()} {platform.system()}",
            "date": datetime.date.today().isoformat(),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "shapes": {"original": LLAMA3_8B, "export": {"kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": ROPE_DIM}},
            "kv_values_per_token_per_layer": {
                "original": 2 * LLAMA3_8B["num_key_value_heads"] * LLAMA3_8B["head_dim"],
                "export": KV_LORA_RANK + ROPE_DIM,
            },
            "runs": runs,
            "ratios_export_over_original": {
                "output_tokens_per_s": e["output_tokens_per_s"] / o["output_tokens_per_s"],
                "time_per_output_token": e["time_per_output_token_ms"] / o["time_per_output_token_ms"],
                "kv_cache_tokens": (e["kv_cache_tokens"] / o["kv_cache_tokens"])
                if o["kv_cache_tokens"] and e["kv_cache_tokens"]
                else None,
            },
            "correctness_small_export": correctness,
            "total_time_s": round(time.perf_counter() - started, 1),
        }
        RESULTS.write_text(json.dumps(document, indent=2) + "\n")
        print(json.dumps(document, indent=2))
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
