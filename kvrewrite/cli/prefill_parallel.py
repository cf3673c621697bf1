"""`kvrewrite prefill-parallel`: prefill a prompt across N local processes (gloo), then decode on rank 0.

The process count and the prompt are checked against the checkpoint before any process starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.table import Table

from kvrewrite.errors import InvalidArgumentError, KVRewriteError


def read_prompt(path: Path) -> str:
    """--prompt-file as text: a file, UTF-8, not empty (checked before any process starts)."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise InvalidArgumentError(f"--prompt-file {path} {what}; give a text file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            f"--prompt-file {path} is not UTF-8 text (byte {exc.start} is not); give a text file"
        ) from None
    if "\x00" in text or not text.strip():
        raise InvalidArgumentError(f"--prompt-file {path} is {'binary' if text.strip() else 'empty'}; give a text file")
    return text


def check_options(directory: Path, nproc: int, rate, new_tokens: int, threads: int) -> dict:
    """Every option against the checkpoint, before any process starts: the spec (config.json, verified)."""
    from kvrewrite.runtime.checkpoint_files import verify_checkpoint_files
    from kvrewrite.spec import CompressionSpec

    if threads < 1:
        raise InvalidArgumentError(f"--threads {threads}: each process needs at least 1 torch thread")
    if new_tokens < 0:
        raise InvalidArgumentError(f"--new-tokens {new_tokens}: give 0 or more tokens to decode")
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
        spec = config["kvrewrite"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KVRewriteError(
            f"{config_path}: unreadable or has no kvrewrite spec ({exc}); is {directory} a kvrewrite "
            "checkpoint? (prefill-parallel runs the per-head forms of kvrewrite compress)"
        ) from None
    verify_checkpoint_files(directory)  # the spec read here, and the tokenizer read next, are the ones written
    if rate is not None:
        CompressionSpec.from_dict(spec).ranks_for_rate(rate)  # a rate off the table, named now, not in a worker
    return spec


def check_before_start(directory: Path, nproc: int, prompt_length: int, spec: dict | None = None) -> int:
    """The checkpoint's query heads, after refusing an impossible process count (reads config.json only)."""
    config_path = directory / "config.json"
    if spec is None:
        try:
            spec = json.loads(config_path.read_text())["kvrewrite"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KVRewriteError(
                f"{config_path}: unreadable or has no kvrewrite spec ({exc}); is {directory} a kvrewrite checkpoint?"
            ) from exc
    heads = spec["num_attention_heads"]
    if nproc < 1 or nproc > heads:
        raise InvalidArgumentError(
            f"--nproc {nproc}: the model has {heads} query heads and every process attends for at "
            f"least one (use 1 to {heads})"
        )
    if prompt_length < nproc:
        raise InvalidArgumentError(f"the prompt has {prompt_length} tokens, fewer than --nproc {nproc}")
    return heads


def worker(rank: int, world: int, directory: str, input_ids: torch.Tensor, rate, new_tokens: int) -> dict:
    """One process: load, prefill its slice, and (rank 0) decode from the gathered cache."""
    import torch.distributed as dist

    import kvrewrite
    from kvrewrite.runtime.sequence_parallel import greedy_continue, head_runs, prefill

    started = time.perf_counter()
    # The plain cache at `rate`: a token policy recorded by `kvrewrite budget` (tiers) is not what this prefill runs.
    model = kvrewrite.load(directory, rate=rate, token_policy=False).eval()
    loaded = time.perf_counter()
    dist.barrier()
    begin = time.perf_counter()
    result = prefill(model, input_ids, cache_on="first")
    prefilled = time.perf_counter()
    generated = greedy_continue(model, result, new_tokens)[0].tolist() if rank == 0 and new_tokens > 0 else []
    return {
        "rank": rank,
        "tokens": list(result.tokens),
        "heads": list(head_runs(model.compressed_attentions()[0].num_heads, world)[rank]),
        "load_s": loaded - started,
        "prefill_s": prefilled - begin,
        "decode_s": time.perf_counter() - prefilled,
        "sent_bytes": result.collectives.bytes_by_name(),
        "generated": generated,
    }


def worker_error_line(exc: Exception) -> str:
    """The exception line of a spawned process's traceback (without its module path), else the message itself."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    head, _, message = last.partition(": ")
    return message if message and "." in head and " " not in head else last


def size(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def rank_table(results: list[dict]) -> Table:
    table = Table(title="sequence-parallel prefill, per process")
    for column in (
        "rank",
        "prompt tokens",
        "query heads",
        "load s",
        "prefill s",
        "q/k/v sent",
        "outputs sent",
        "cache sent",
    ):
        table.add_column(column, justify="right")
    for r in results:
        (t0, t1), (h0, h1), sent = r["tokens"], r["heads"], r["sent_bytes"]
        table.add_row(
            str(r["rank"]),
            f"{t0}..{t1 - 1}",
            f"{h0}..{h1 - 1}",
            f"{r['load_s']:.1f}",
            f"{r['prefill_s']:.2f}",
            *(size(sent.get(k, 0)) for k in ("qkv", "output", "cache")),
        )
    return table


def total_sent_bytes(results: list[dict]) -> dict[str, int]:
    """Bytes sent between processes, per collective, summed over the processes."""
    return {k: sum(r["sent_bytes"].get(k, 0) for r in results) for k in ("qkv", "output", "cache", "last_logits")}


def summary_table(results: list[dict], prompt_tokens: int, new_tokens: int) -> Table:
    table = Table(title="summary", show_header=False)
    table.add_column("what")
    table.add_column("value")
    total = total_sent_bytes(results)
    table.add_row("processes", str(len(results)))
    table.add_row("prompt tokens", str(prompt_tokens))
    table.add_row("prefill wall time", f"{max(r['prefill_s'] for r in results):.2f} s (slowest process)")
    table.add_row("first all-to-all (packed q/k/v)", f"{size(total['qkv'])} between processes")
    table.add_row("second all-to-all (attention outputs)", size(total["output"]))
    table.add_row("cache gathered to rank 0", size(total["cache"]))
    table.add_row(f"decode of {new_tokens} tokens on rank 0", f"{results[0]['decode_s']:.2f} s")
    return table


def run(directory: Path, prompt: str, nproc: int, rate, new_tokens: int, threads: int, console) -> dict:
    from kvrewrite.io.tokenizer_loading import load_tokenizer
    from kvrewrite.runtime.sequence_parallel import run_processes
    from kvrewrite.runtime.tiers.token_policy_file import read_cache_policy

    spec = check_options(directory, nproc, rate, new_tokens, threads)
    tokenizer = load_tokenizer(directory)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    heads = check_before_start(directory, nproc, input_ids.shape[1], spec)
    if rate is None and read_cache_policy(directory) is not None:
        console.print(
            "note: the token policy recorded by `kvrewrite budget` is not used: the sequence-parallel prefill "
            f"runs the plain cache at the compiled rate {spec['target_rate']:g} (--rate picks another)"
        )
    console.print(
        f"prefilling {input_ids.shape[1]} tokens across {nproc} processes (gloo, {threads} thread(s) each, "
        f"{heads} query heads split over them) ..."
    )
    import logging

    # torch logs each sibling it terminates after a worker failed; the failure itself is reported below, in one line.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        results = run_processes(worker, nproc, str(directory), input_ids, rate, new_tokens, threads=threads)
    except KVRewriteError:
        raise
    except Exception as exc:  # a worker's failure arrives as its formatted traceback: keep its last line
        raise KVRewriteError(f"a prefill process failed: {worker_error_line(exc)}") from None
    console.print(rank_table(results))
    console.print(summary_table(results, input_ids.shape[1], new_tokens))
    text = tokenizer.decode(results[0]["generated"])
    console.print(f"[bold]next {new_tokens} tokens (greedy, rank 0):[/] {text!r}")
    return {
        "prompt_tokens": input_ids.shape[1],
        "processes": nproc,
        "rate": rate,
        "new_tokens": new_tokens,
        "total_sent_bytes": total_sent_bytes(results),
        "results": results,
        "text": text,
    }
