"""Compile the flash-decoding kernels for Hopper (sm_90) on a machine with no GPU and record what the compiler made.

No timing: this is the no-device-time half of sizing a kernel (what registers, spills, shared memory and load
instructions each configuration gets), used to pick the block sizes, warps and stages in kernels/flash_decode_*.py
before any GPU run. Triton's bundled ptxas and cuobjdump do the work; nothing is launched.

  PYTHONPATH=. .venv/bin/python benchmarks/flash_decode_resources.py

Writes benchmarks/results/flash_decode_resources_sm90.json. Shapes: Llama-3-8B attention at p = 0.5 (8 KV heads,
group 4, head_dim 128, key and value rank 64, bf16 rows of 512 columns), a real SmolLM2 freq p = 0.5 rank mix
(unaligned offsets: narrow loads), absorbed MLA 512 + 64 with 32 heads, and the int4 KIVI store. Pointer arguments
are taken as 16-byte aligned and an integer argument as divisible by 16 exactly when its value is, as Triton's
launcher specialises them.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvrewrite.runtime.kernels import (
    flash_decode_coded,
    flash_decode_latent,
    flash_decode_mla,
    flash_decode_packed,
    flash_decode_splits,
    kept_settle_kernel,
    kept_tier_kernels,
    kept_window_kernels,
)
from kvrewrite.runtime.kernels.flash_decode_packed import tile_columns
from kvrewrite.runtime.kernels.flash_decode_splits import column_alignment, decode_tile, pow2
from kvrewrite.runtime.kernels.reference import PackedLayout

RESULTS = Path(__file__).parent / "results" / "flash_decode_resources_sm90.json"
TARGET = GPUTarget("cuda", 90, 32)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SASS_OPS = {
    "HMMA": r"\bHMMA\b",
    "HGMMA": r"\bHGMMA\b",
    "LDGSTS": r"\bLDGSTS\b",
    "LDG.128": r"\bLDG\.E\.128\b",
    "LDG.64": r"\bLDG\.E\.64\b",
    "STL": r"\bSTL\b",
    "LDL": r"\bLDL\b",
}
DTYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


def compile_sm90(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """args: name -> torch dtype (a pointer), int or float; every non-constexpr parameter must be named."""
    params = list(inspect.signature(kernel.fn).parameters)
    signature, attrs = {}, {}
    for i, name in enumerate(params):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, torch.dtype):
            signature[name] = DTYPES[value]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0 and name not in getattr(kernel, "do_not_specialize", ()):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(
        kernel, signature, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    compiled = triton.compile(source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [TOOLS / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [TOOLS / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    return {
        "num_warps": num_warps,
        "num_stages": num_stages,
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": compiled.metadata.shared,
        "sass": {op: len(re.findall(pattern, sass)) for op, pattern in SASS_OPS.items()},
    }


def packed_case(layout: PackedLayout, splits: int, row_multiple: int = 1) -> tuple[dict, dict, dict]:
    """Arguments and constexprs of a packed-kernel launch over bf16 rows padded to a multiple of row_multiple
    columns, with the tile choices the wrapper makes for them (flash_decode_packed.tile_columns)."""
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    k_row, v_row = -(-ks // row_multiple) * row_multiple, -(-vs // row_multiple) * row_multiple
    keys = torch.empty(1, 8192, k_row, dtype=torch.bfloat16)[..., :ks]
    values = torch.empty(1, 8192, v_row, dtype=torch.bfloat16)[..., :vs]
    k_align, k_window, block_dk = tile_columns(layout.key_offsets, keys)
    v_align, v_window, block_dv = tile_columns(layout.value_offsets, values)
    bf = torch.bfloat16
    args = dict(
        q_ptr=bf,
        k_ptr=bf,
        v_ptr=bf,
        mask_ptr=torch.int8,
        kv_len_ptr=torch.int64,
        tasks_ptr=torch.int32,
        q_off_ptr=torch.int32,
        k_off_ptr=torch.int32,
        v_off_ptr=torch.int32,
        o_off_ptr=torch.int32,
        k_rank_ptr=torch.int32,
        v_rank_ptr=torch.int32,
        chunk_ptr=torch.int32,
        o_ptr=bf,
        acc_ptr=torch.float32,
        m_ptr=torch.float32,
        l_ptr=torch.float32,
        up_ptr=bf,
        cos_ptr=bf,
        sin_ptr=bf,
        s_cap=8192,
        qk_scale=0.1,
        half_d=64,
        s_qb=layout.query_offsets[-1],
        s_kb=8192 * k_row,
        s_ks=k_row,
        s_vb=8192 * v_row,
        s_vs=v_row,
        s_mb=8192,
        s_ob=layout.output_offsets[-1],
        s_ug=128 * 128,
        s_ur=128,
        s_cs=128,
        s_ss=128,
    )
    g = layout.group_size
    # The workspace strides follow the real allocation: [B, Hq, splits, BLOCK_DV] and [B, Hq, splits].
    n_q = len(layout.key_ranks) * g
    args.update(s_ab=n_q * splits * block_dv, s_ah=splits * block_dv, s_as=block_dv, s_lb=n_q * splits, s_lh=splits)
    consts = dict(
        GROUP=g,
        BLOCK_G=pow2(g),
        BLOCK_DK=block_dk,
        BLOCK_DV=block_dv,
        HAS_KV_LEN=True,
        PARTIAL=splits > 1,
        UPCAST=False,
        K_ALIGN=k_align,
        V_ALIGN=v_align,
        K_WINDOW=k_window,
        V_WINDOW=v_window,
    )
    return (
        args,
        consts,
        {
            "key_ranks": layout.key_ranks,
            "value_ranks": layout.value_ranks,
            "group": g,
            "splits": splits,
            "row_multiple": row_multiple,
            "K_ALIGN": k_align,
            "V_ALIGN": v_align,
            "K_WINDOW": k_window,
            "V_WINDOW": v_window,
        },
    )


def kept_tier_records() -> list[dict]:
    """The eviction kept tier's two decode kernels at the frontier recipe's Llama-3-8B form: full rank (8 KV heads
    x 128 columns a side, group 4), 8-bit keys and 4-bit values in groups of 64 channels, 4,670 kept rows of a
    cache of 8,208 (57% of 8K)."""
    cap, rows, channels, groups = 8208, 4670, 1024, 1024 // 64
    shared = dict(codes_ptr=torch.uint8, scale_ptr=torch.float16, low_ptr=torch.float16, col_ptr=torch.int32)
    shared.update(rank_ptr=torch.int32, n_rows=rows, rows_per_program=kept_tier_kernels.ROWS_PER_PROGRAM)
    block = kept_tier_kernels.BLOCK_ROWS
    consts = dict(GROUP=4, BLOCK_G=pow2(4), BLOCK_R=128, GROUP_SIZE=64)
    key_args = dict(
        shared,
        q_ptr=torch.bfloat16, pos_ptr=torch.int32, mask_ptr=torch.int8, up_ptr=torch.bfloat16,
        shift_ptr=torch.float32, cos_ptr=torch.bfloat16, sin_ptr=torch.bfloat16, out_ptr=torch.float32,
        m_ptr=torch.float32, l_ptr=torch.float32, half_d=64, qk_scale=0.088,
        s_qb=32 * 128, s_cb=cap * channels, s_cs=channels, s_gb=cap * groups, s_gs=groups, s_pb=cap, s_mb=cap,
        s_ub=8 * 128 * 128, s_ug=128 * 128, s_ur=128, s_hb=8 * 128, s_hg=128, s_cos=128, s_sin=128,
        s_ob=32 * rows, s_oh=rows, s_lb=32 * 5, s_lh=5,
    )  # fmt: skip
    value_args = dict(
        shared,
        logits_ptr=torch.float32, lse_ptr=torch.float32, pos_ptr=torch.int32, mask_ptr=torch.int8,
        weight_ptr=torch.float32, out_ptr=torch.float32, evidence_ptr=torch.float32,
        s_pb=32 * rows, s_ph=rows, s_eb=32, s_xb=cap, s_mb=cap, s_wb=1, s_cb=cap * channels // 2,
        s_cs=channels // 2, s_gb=cap * groups, s_gs=groups, s_ob=32 * 5 * 128, s_oh=5 * 128, s_oc=128,
        s_vb=8 * rows, s_vg=rows,
    )  # fmt: skip
    records = []
    warps, stages = kept_tier_kernels.NUM_WARPS, kept_tier_kernels.NUM_STAGES
    for rows_per_block, note in ((block, ""), (2 * block, " (rejected)")):
        sized = dict(consts, BLOCK_N=rows_per_block)
        key_consts = dict(sized, HALF=64, BITS=8, UPCAST=False)
        result = compile_sm90(kept_tier_kernels._kept_logits_kernel, key_args, key_consts, warps, stages)
        name = f"kept tier logits k8 llama3-8b, {rows_per_block} rows{note}"
        records.append({"kernel": name, "shape": {"rows": rows}, "BLOCK_N": rows_per_block, **result})
        value_consts = dict(sized, BITS=4, DOT_DTYPE=triton.language.bfloat16, EVIDENCE_MAX=False)
        result = compile_sm90(kept_tier_kernels._kept_value_kernel, value_args, value_consts, warps, stages)
        name = f"kept tier values v4 llama3-8b, {rows_per_block} rows{note}"
        records.append({"kernel": name, "shape": {"rows": rows}, "BLOCK_N": rows_per_block, **result})
    return records


def kept_step_records() -> list[dict]:
    """The rest of an evicting layer's decode step at the same form: the window kernels (a window of 16 + the new
    token, 32 query heads) and the settle kernel (8-bit keys, 4-bit values, groups of 64, 4,670 kept rows)."""
    cap, rows, heads, window, d = 8208, 4670, 32, 17, 128
    bf, f32 = torch.bfloat16, torch.float32
    records = []
    consts = dict(GROUP=4, BLOCK_G=pow2(4), BLOCK_W=pow2(window), BLOCK_D=d)
    args = dict(
        q_ptr=bf, q_out_ptr=bf, keys_ptr=torch.float16, up_ptr=bf, cos_ptr=bf, sin_ptr=bf, mask_ptr=torch.int8,
        logits_ptr=f32, wmax_ptr=f32, wsum_ptr=f32, q_pos=cap - 1, first_pos=cap - window, n_window=window,
        half_d=d // 2, qk_scale=0.088, s_qb=heads * d, s_ob=heads * d, s_kb=window * 8 * d, s_kw=8 * d,
        s_ug=d * d, s_ur=d, s_cos=d, s_sin=d, s_mb=cap, s_lb=heads * window, s_lh=window, s_sb=heads,
    )  # fmt: skip
    logits_consts = dict(consts, HALF=d // 2, DOT_DTYPE=triton.language.bfloat16, PRECISION="tf32")
    result = compile_sm90(kept_window_kernels._window_logits_kernel, args, logits_consts, 4, 1)
    records.append({"kernel": "kept step: window logits", "shape": {"window": window}, **result})
    # A window twice as long as the kernels take (tiers/kept_decode.MAX_WINDOW_ROWS = 32 rows, the new token included).
    longest = dict(logits_consts, BLOCK_W=64)
    result = compile_sm90(kept_window_kernels._window_logits_kernel, dict(args, n_window=64), longest, 4, 1)
    records.append({"kernel": "kept step: window logits, 64 rows (rejected)", "shape": {"window": 64}, **result})
    args = dict(
        maxima_ptr=f32, sums_ptr=f32, wmax_ptr=f32, wsum_ptr=f32, logits_ptr=f32, values_ptr=torch.float16,
        weight_ptr=f32, lse_ptr=f32, mass_ptr=f32, out_ptr=f32, evidence_ptr=f32, chunks=5, n_window=window,
        head_dim=d, s_mb=heads * 5, s_mh=5, s_sb=heads, s_lb=heads * window, s_lh=window, s_vb=window * 8 * d,
        s_vw=8 * d, s_wb=1, s_ob=heads * d, s_oh=d, s_eb=8 * window, s_eg=window,
    )  # fmt: skip
    finish = dict(consts, BLOCK_C=pow2(5), EVIDENCE_MAX=False)
    result = compile_sm90(kept_window_kernels._window_finish_kernel, args, finish, 4, 1)
    records.append({"kernel": "kept step: window finish", "shape": {"window": window, "chunks": 5}, **result})
    result = compile_sm90(
        kept_window_kernels._window_finish_kernel, dict(args, n_window=64), dict(finish, BLOCK_W=64), 4, 1
    )
    records.append(
        {"kernel": "kept step: window finish, 64 rows (rejected)", "shape": {"window": 64, "chunks": 5}, **result}
    )
    args = dict(
        partial_ptr=f32, mass_ptr=f32, matrix_ptr=f32, offset_ptr=f32, window_out_ptr=f32, out_ptr=bf, chunks=5,
        rank=d, head_dim=d, s_pb=heads * 5 * d, s_ph=5 * d, s_pc=d, s_sb=heads, s_xb=8 * d * d, s_xg=d * d,
        s_xr=d, s_fb=8 * d, s_fg=d, s_wb=heads * d, s_wh=d, s_ob=heads * d, s_oh=d,
    )  # fmt: skip
    result = compile_sm90(
        kept_window_kernels._kept_finish_kernel, args, dict(GROUP=4, BLOCK_G=16, BLOCK_R=d, BLOCK_D=d), 4, 1
    )
    records.append({"kernel": "kept step: kept finish", "shape": {"chunks": 5}, **result})
    channels, groups = 8 * d, 8 * d // 64
    args = dict(
        key_window_ptr=torch.float16, value_window_ptr=torch.float16, s_kw=window * channels, s_vw=window * channels,
        key_cols_ptr=torch.int32, key_starts_ptr=torch.int32, key_ranks_ptr=torch.int32, value_cols_ptr=torch.int32,
        value_starts_ptr=torch.int32, value_ranks_ptr=torch.int32, key_mean_ptr=torch.float16,
        key_rms_ptr=torch.float16, value_mean_ptr=torch.float16, value_rms_ptr=torch.float16, s_km=channels,
        s_vm=channels, key_rot_ptr=f32, s_krg=d * d, s_krr=d, value_rot_ptr=f32, s_vrg=d * d, s_vrr=d,
        scratch_ptr=f32, s_xb=2 * channels, key_channels=channels, value_channels=channels, scores_ptr=f32,
        moving_ptr=f32, s_sb=rows, s_mb=window, pos_ptr=torch.int32, s_pb=cap, n_old=rows, position=cap - window,
        k_codes_ptr=torch.uint8, k_scale_ptr=torch.float16, k_low_ptr=torch.float16, s_kcb=cap * channels,
        s_kcs=channels, s_kgb=cap * groups, s_kgs=groups, v_codes_ptr=torch.uint8, v_scale_ptr=torch.float16,
        v_low_ptr=torch.float16, s_vcb=cap * channels // 2, s_vcs=channels // 2, s_vgb=cap * groups, s_vgs=groups,
    )  # fmt: skip
    settle = dict(
        EVICT=True, N_HEADS=8, BLOCK_RK=d, BLOCK_RV=d, GROUP_SIZE=64, BLOCK_GS=64, K_GROUPS=groups,
        V_GROUPS=groups, K_BITS=8, V_BITS=4, ROWS=kept_settle_kernel.ROWS_BLOCK,
    )  # fmt: skip
    result = compile_sm90(kept_settle_kernel._settle_kernel, args, settle, 4, 1)
    records.append({"kernel": "kept step: settle", "shape": {"rows": rows}, **result})
    return records


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    records = []
    llama = PackedLayout((64,) * 8, (64,) * 8, 4)
    smollm = PackedLayout((60, 38, 56), (6, 10, 3), 3)  # freq p = 0.5 layer 0 (benchmarks/decode_kernels.py)
    cases = (
        ("packed llama3-8b p=0.5", llama, 1),
        ("packed smollm2 freq p=0.5 layer 0", smollm, 1),
        ("packed smollm2 freq p=0.5 layer 0, rows padded to 16", smollm, 16),
    )
    for name, layout, row_multiple in cases:
        args, consts, shape = packed_case(layout, 2, row_multiple)
        width = max(max(layout.key_ranks), max(layout.value_ranks))
        consts.update(BLOCK_N=decode_tile(width, 2))
        result = compile_sm90(
            flash_decode_packed._packed_split_kernel,
            args,
            consts,
            flash_decode_packed.NUM_WARPS,
            flash_decode_packed.NUM_STAGES,
        )
        records.append({"kernel": name, "shape": shape, "BLOCK_N": consts["BLOCK_N"], **result})
    args, consts, shape = packed_case(llama, splits=2)
    consts.pop("BLOCK_DK")
    for warps in (4, 8):  # the wrapper picks 8 for [64, 64] up-projection halves
        consts.update(BLOCK_N=decode_tile(128, 2), BLOCK_R=64, HALF=64, SAME_HALVES=True)
        result = compile_sm90(
            flash_decode_latent._latent_split_kernel, args, consts, warps, flash_decode_latent.NUM_STAGES
        )
        records.append(
            {"kernel": "latent llama3-8b p=0.5 head_dim 128", "shape": shape, "BLOCK_N": consts["BLOCK_N"], **result}
        )
    heads, rank, rope = 32, 512, 64
    for block_h, stages in ((32, flash_decode_mla.NUM_STAGES), (32, 2), (64, 1)):
        splits = 4
        mla_args = dict(
            q_ptr=torch.bfloat16,
            rows_ptr=torch.bfloat16,
            mask_ptr=torch.int8,
            kv_len_ptr=torch.int64,
            o_ptr=torch.bfloat16,
            acc_ptr=torch.float32,
            m_ptr=torch.float32,
            l_ptr=torch.float32,
            s_cap=8192,
            heads=heads,
            rank=rank,
            rope_dim=rope,
            chunk=2048,
            qk_scale=0.1,
            s_qb=heads * (rank + rope),
            s_qh=rank + rope,
            s_rb=8192 * (rank + rope),
            s_rs=rank + rope,
            s_mb=8192,
            s_ob=heads * rank,
            s_oh=rank,
            s_ab=heads * splits * rank,
            s_ah=splits * rank,
            s_as=rank,
            s_lb=heads * splits,
            s_lh=splits,
        )
        block_n = flash_decode_mla.mla_tile(rank)
        mla_consts = dict(
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            BLOCK_R=pow2(rank),
            BLOCK_PE=pow2(rope),
            HAS_KV_LEN=True,
            PARTIAL=True,
            UPCAST=False,
        )
        result = compile_sm90(
            flash_decode_mla._mla_split_kernel, mla_args, mla_consts, flash_decode_mla.NUM_WARPS, stages
        )
        records.append(
            {
                "kernel": "mla 512+64",
                "shape": {"heads": heads, "rank": rank, "rope_dim": rope, "BLOCK_H": block_h},
                "BLOCK_N": block_n,
                **result,
            }
        )
    # int4 KIVI store at the same shapes: blocks of 32 tokens, value groups of 32 channels, float16 window.
    args, consts, shape = packed_case(llama, splits=2)
    for name in ("K_WINDOW", "V_WINDOW"):
        consts.pop(name)
    consts.update(K_ALIGN=column_alignment(llama.key_offsets, 0.5), V_ALIGN=column_alignment(llama.value_offsets, 0.5))
    n_cap, block_tokens = 256, 32
    args.update(
        kc_ptr=torch.uint8,
        ks_ptr=torch.float16,
        kl_ptr=torch.float16,
        vc_ptr=torch.uint8,
        vs_ptr=torch.float16,
        vl_ptr=torch.float16,
        kw_ptr=torch.float16,
        vw_ptr=torch.float16,
        n_coded_ptr=torch.int64,
        window_len_ptr=torch.int64,
        n_split_ptr=torch.int32,
        n_cap=n_cap,
        w_cap=64,
        key_channels=512,
        value_channels=512,
        s_kcb=n_cap * 32 * 512 // 2,
        s_kcn=32 * 512 // 2,
        s_ksb=n_cap * 512,
        s_ksn=512,
        s_vcb=n_cap * 32 * 512 // 2,
        s_vcn=32 * 512 // 2,
        s_vsb=n_cap * 32 * 16,
        s_vsn=32 * 16,
        s_vst=16,
        s_kwb=64 * 512,
        s_kwt=512,
        s_vwb=64 * 512,
        s_vwt=512,
    )
    consts.update(
        BLOCK_T=block_tokens,
        BLOCK_W=flash_decode_coded.WINDOW_TILE,
        BLOCK_DK=64,
        BITS=4,
        VALUE_GROUP=32,
        HAS_COUNTS=True,
        K_PAIRS=True,
        V_PAIRS=True,
    )
    consts.pop("HAS_KV_LEN")
    result = compile_sm90(
        flash_decode_coded._coded_split_kernel,
        args,
        consts,
        flash_decode_coded.NUM_WARPS,
        flash_decode_coded.NUM_STAGES,
    )
    records.append(
        {
            "kernel": "coded int4 llama3-8b p=0.5",
            "shape": dict(shape, block_tokens=block_tokens),
            "BLOCK_N": block_tokens,
            **result,
        }
    )
    records += kept_tier_records()
    records += kept_step_records()
    merge_args = dict(
        acc_ptr=torch.float32,
        m_ptr=torch.float32,
        l_ptr=torch.float32,
        o_ptr=torch.bfloat16,
        o_off_ptr=torch.int32,
        o_width_ptr=torch.int32,
        n_split_ptr=torch.int32,
        s_ab=32 * 8 * 64,
        s_ah=8 * 64,
        s_as=64,
        s_mb=32 * 8,
        s_mh=8,
        s_ob=32 * 64,
    )
    result = compile_sm90(flash_decode_splits._merge_kernel, merge_args, dict(SPLITS=8, BLOCK_D=64), 4, 1)
    records.append({"kernel": "merge", "shape": {"splits": 8, "width": 64}, **result})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "gpu": "none: compiled offline for the target"},
        "target": "sm_90",
        "triton": triton.__version__,
        "results": records,
    }
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'kernel':<36} {'warps':>5} {'stages':>6} {'regs':>4} {'stack':>5} {'shared':>7}  sass")
    for r in records:
        print(
            f"{r['kernel']:<36} {r['num_warps']:>5} {r['num_stages']:>6} {r['registers']:>4} {r['stack_bytes']:>5} "
            f"{r['shared_bytes']:>7}  {r['sass']}"
        )


if __name__ == "__main__":
    main()
