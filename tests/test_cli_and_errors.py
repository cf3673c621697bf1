"""Bad input is refused early with a clear message; the CLI commands work on a tiny compiled model."""

from __future__ import annotations

import math
import re

import pytest
import torch
from tiny_models import save_tiny_llama, tiny_pipeline, word_tokenizer
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
from typer.testing import CliRunner

import kvrewrite
from kvrewrite.cli.app import app
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.load_checkpoint import LoadCheckpoint
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError, UnsupportedModelError

runner = CliRunner()


def flat(output: str) -> str:
    """CLI output with rich's line wrapping undone."""
    return " ".join(output.split())


@pytest.mark.parametrize("rate", [1.0, 1.5, -0.1, math.nan, "abc"])
def test_rate_outside_unit_interval_is_refused(rate):
    with pytest.raises(InvalidArgumentError, match=r"\[0, 1\)"):
        Plan(model="x", target_rate=rate)


@pytest.mark.parametrize(
    "option,value", [("objective", "svd"), ("allocation", "random"), ("rope_mode", "none"), ("reduce", "pca")]
)
def test_unknown_choices_are_refused(option, value):
    with pytest.raises(InvalidArgumentError, match=f"`{option}` must be one of"):
        Plan(model="x", **{option: value})


def test_cli_rate_error_exits_nonzero_with_message():
    result = runner.invoke(app, ["compress", "smollm2-135m", "--target-rate", "1.5"])
    assert result.exit_code == 2
    assert "[0, 1)" in flat(result.output)


def test_unsupported_architecture_fails_before_loading_weights(tmp_path, monkeypatch):
    config = GPTNeoXConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64, vocab_size=96
    )
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    word_tokenizer().save_pretrained(tmp_path / "neox")

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the architecture check")

    monkeypatch.setattr("kvrewrite.io.source_model.AutoModelForCausalLM.from_pretrained", no_weights)
    ctx = CompileContext(plan=Plan(model=str(tmp_path / "neox"), progress=False))
    with pytest.raises(
        UnsupportedModelError,
        match="'gpt_neox'.*supported model types: gemma3_text, gpt2, llama, mistral, opt, phi3, qwen2, qwen3",
    ):
        LoadCheckpoint().run(ctx)


def test_existing_output_is_kept_without_overwrite(tmp_path):
    src = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous result")
    with pytest.raises(InvalidArgumentError, match="pass `overwrite`"):
        run_pipeline(Plan(model=str(src), output=out, progress=False), tiny_pipeline())
    assert (out / "keep.txt").read_text() == "previous result"
    # --overwrite replaces only a kvrewrite checkpoint: user files are never deleted (issue 14).
    with pytest.raises(InvalidArgumentError, match="not a kvrewrite checkpoint"):
        run_pipeline(Plan(model=str(src), output=out, overwrite=True, progress=False), tiny_pipeline())
    assert (out / "keep.txt").read_text() == "previous result"


def test_interrupted_compile_leaves_no_output(tmp_path, monkeypatch):
    src = save_tiny_llama(tmp_path / "src")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvrewrite.compile.passes.emit.write_manifest", interrupt)  # Ctrl-C during the final write
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(Plan(model=str(src), output=tmp_path / "out", progress=False), tiny_pipeline())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_dry_run_prints_the_pipeline():
    result = runner.invoke(app, ["compress", "smollm2-135m", "--target-rate", "0.6", "--dry-run"])
    assert result.exit_code == 0
    for name in ("collect_statistics", "compute_transforms", "allocate_ranks", "fold_weights", "verify", "emit"):
        assert name in result.output


def test_inspect_prints_ranks_and_writes_heat_map(tmp_path):
    src = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    ctx = run_pipeline(Plan(model=str(src), output=out, progress=False), tiny_pipeline())
    result = runner.invoke(app, ["inspect", str(out), "--plot", str(tmp_path / "ranks.png")])
    assert result.exit_code == 0, result.output
    assert f"{ctx.spec.kept_elements_per_token} of {ctx.spec.baseline_elements_per_token}" in flat(result.output)
    assert (tmp_path / "ranks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = runner.invoke(app, ["inspect", str(out), "--rate", "0.3", "--plot", str(tmp_path / "r30.png")])
    assert other.exit_code == 0 and "0.300" in flat(other.output)
    missing = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no config.json" in flat(missing.output)


def test_compress_command_end_to_end_on_local_text(tmp_path):
    src = save_tiny_llama(tmp_path / "src")
    text = tmp_path / "calib.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(3, 96, (3000,), generator=g)))
    result = runner.invoke(
        app,
        [
            "compress",
            str(src),
            "--target-rate",
            "0.5",
            "-o",
            str(tmp_path / "out"),
            "--calibration",
            str(text),
            "--calib-tokens",
            "512",
            "--seq-len",
            "64",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "achieved rate" in flat(result.output) and (tmp_path / "out" / "config.json").is_file()
    short = runner.invoke(
        app, ["compress", str(src), "-o", str(tmp_path / "o2"), "--calibration", str(text), "--calib-tokens", "100000"]
    )
    assert short.exit_code == 2 and "100000" in flat(short.output).replace(",", "")


def compress_command():
    import typer.main

    return typer.main.get_command(app).commands["compress"]


def test_every_plan_field_is_a_compress_option_with_the_plans_default():
    """The CLI's defaults come from the Plan: every field is an option whose default parses back to the Plan's,
    or library-only with a reason; nothing restated by hand can drift."""
    import dataclasses

    from kvrewrite.cli.compress_options import LIBRARY_ONLY, OPTIONS_BY_FIELD

    params = {p.name: p for p in compress_command().params}
    for field in dataclasses.fields(Plan):
        if field.name in LIBRARY_ONLY:
            assert LIBRARY_ONLY[field.name], field.name
            continue
        assert field.name in params, f"Plan.{field.name} is neither a compress option nor listed in LIBRARY_ONLY"
        option = OPTIONS_BY_FIELD[field.name]
        assert option.flag in params[field.name].opts and params[field.name].help
        shown = params[field.name].default
        parsed = option.parse(shown, option.flag) if option.parse is not None and shown is not None else shown
        assert parsed == field.default, (field.name, shown, field.default)
    # Library-only fields are really not options (and options the command adds itself are not Plan fields).
    assert not (set(LIBRARY_ONLY) - {"model"}) & set(params)
    assert set(params) - {f.name for f in dataclasses.fields(Plan)} == {
        "dry_run",
        "push_to_hub",
        "hub_private",
        "kv_budget",
    }


def test_new_compress_options_reach_the_plan(monkeypatch):
    """Options that used to be library-only (k-means, rate grid, Fisher, probe windows, refit ridge) reach the Plan."""
    seen = {}

    def capture(plan, passes=None, on_pass=None):
        seen["plan"] = plan
        raise InvalidArgumentError("stop")

    # The command runs kvrewrite.compress, which hands its plan to run_pipeline: stopped there, before any work.
    monkeypatch.setattr("kvrewrite.compile.api.run_pipeline", capture)
    monkeypatch.setattr("kvrewrite.cli.app.require_compile_extra", lambda *a, **k: None)
    result = runner.invoke(
        app,
        [
            "compress",
            "smollm2-135m",
            "--kmeans-clusters",
            "64",
            "--kmeans-keep-share",
            "0.25",
            "--rate-grid",
            "0.2,0.4",
            "--fisher-tokens",
            "1024",
            "--fisher-shrink",
            "0.1",
            "--probe-windows",
            "3",
            "--refit",
            "output",
            "--refit-ridge",
            "0.01",
            "--probe-rates",
            "0.3,0.6",
        ],
    )
    assert result.exit_code == 2 and "stop" in result.output
    plan = seen["plan"]
    assert (plan.kmeans_clusters, plan.kmeans_keep_share, plan.rate_grid) == (64, 0.25, (0.2, 0.4))
    assert (plan.fisher_tokens, plan.fisher_shrink, plan.probe_windows, plan.refit_ridge) == (1024, 0.1, 3, 0.01)
    assert plan.probe_rates == (0.3, 0.6)


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--objective", "svd"], "--objective must be one of"),
        (["--rope-mode", "none"], "--rope-mode must be one of"),
        (["--kmeans-keep-share", "2"], "--kmeans-keep-share must be in (0, 1]"),
        (["--kv-codec", "int4", "--kv-bits-budget", "4"], "--kv-bits-budget applies to --kv-codec tada"),
        (["--max-shard-size", "lots"], "--max-shard-size must be a size"),
    ],
)
def test_cli_errors_name_flags_where_the_library_names_parameters(args, flag):
    result = runner.invoke(app, ["compress", "smollm2-135m", *args, "--dry-run"])
    assert result.exit_code == 2
    assert flag in flat(result.output) and "`" not in flat(result.output)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--distill-lr", "3e-4"], "--distill-lr only apply with --distill"),
        (["--distill-epochs", "2", "--distill-tokens", "4096"], "--distill-tokens, --distill-epochs only apply"),
        (["--refit-tokens", "4096"], "--refit-tokens only apply with --refit output or output-local"),
        (["--refit", "none", "--refit-ridge", "0.1"], "--refit-ridge only apply with --refit"),
    ],
)
def test_tuning_options_without_their_step_are_refused(args, message):
    """A tuning flag given without the option that turns its step on would be silently ignored; export-mla refuses
    the same combinations."""
    result = runner.invoke(app, ["compress", "smollm2-135m", *args, "--dry-run"])
    assert result.exit_code == 2
    assert message in flat(result.output)


def test_the_api_refuses_tuning_fields_without_their_step(tmp_path):
    """kvrewrite.compress refuses what the command line refuses, before any work: a field that only tunes a step the
    plan does not run, set away from its default; at its default, or with the step on, it passes."""
    for fields, message in (
        ({"distill_lr": 3e-4}, "`distill_lr` only apply with `distill`"),
        ({"refit_tokens": 4096, "refit_ridge": 0.1}, "`refit_tokens`, `refit_ridge` only apply with `refit=output`"),
    ):
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            kvrewrite.compress("no-such-model", output=tmp_path / "out", **fields)
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            kvrewrite.compress_variants(Plan(model="no-such-model"), {"v": fields}, tmp_path / "variants")
    assert not (tmp_path / "out").exists() and not (tmp_path / "variants").exists()
    Plan(model="x", distill=True, distill_lr=3e-4).refuse_idle_tuning()
    Plan(model="x", refit="output", refit_tokens=4096).refuse_idle_tuning()
    Plan(model="x", refit_tokens=Plan.__dataclass_fields__["refit_tokens"].default).refuse_idle_tuning()


def test_tuning_options_with_their_step_are_accepted():
    result = runner.invoke(
        app, ["compress", "smollm2-135m", "--distill", "--distill-lr", "3e-4", "--distill-epochs", "2", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app, ["compress", "smollm2-135m", "--refit", "output", "--refit-tokens", "4096", "--dry-run"]
    )
    assert result.exit_code == 0, result.output


def test_cli_message_maps_parameters_to_flags():
    from kvrewrite.cli.compress_options import PLAN_FLAGS, cli_message

    assert (
        cli_message("rate 0.5 cannot be reached with `min_rank=12`", PLAN_FLAGS)
        == "rate 0.5 cannot be reached with --min-rank 12"
    )
    assert (
        cli_message("use `calibration=wiki`; `max_ppl_increase` or `no_such_name`", PLAN_FLAGS)
        == "use --calibration wiki; --max-ppl-increase or `no_such_name`"
    )
    assert (
        cli_message("pass `overwrite` or choose another `output`", PLAN_FLAGS)
        == "pass --overwrite or choose another --output"
    )


def test_recent_window_option_rejects_bad_values():
    from kvrewrite.cli.app import _parse_windows

    with pytest.raises(InvalidArgumentError, match="--recent-window 'abc'"):
        _parse_windows("abc")
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        _parse_windows("64,-1")
    assert _parse_windows("0, 64,128") == [0, 64, 128]


def test_compress_help_groups_its_options_in_panels():
    """`compress --help` shows its ~50 options in titled panels, every option in exactly one, none left in the
    catch-all Options panel (which keeps only --help)."""
    import re

    from kvrewrite.cli.compress_options import PLAN_OPTIONS

    result = runner.invoke(app, ["compress", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 0, result.output
    panels: dict[str, list[str]] = {}
    for line in result.output.splitlines():
        if title := re.match(r"╭─ (.+?) ─", line):
            current = panels.setdefault(title.group(1), [])
        elif flag := re.match(r"│\s+\*?\s*(--[a-z0-9-]+)", line):
            current.append(flag.group(1))
    assert panels.pop("Options") == ["--help"]
    panels.pop("Arguments")
    where = {flag: title for title, flags in panels.items() for flag in flags}
    assert sum(len(flags) for flags in panels.values()) == len(where)  # no option in two panels
    own = {"--dry-run", "--push-to-hub", "--hub-private", "--kv-budget"}
    assert set(where) == {option.flag for option in PLAN_OPTIONS} | own
    assert list(panels)[:6] == [
        "Rate and key modes",
        "Calibration",
        "Allocation",
        "Refit and distillation",
        "Codecs and cache budget",
        "Output",
    ]
    expected = {
        "--target-rate": "Rate and key modes",
        "--calib-tokens": "Calibration",
        "--calibration": "Calibration",
        "--allocation": "Allocation",
        "--probe-rates": "Allocation",
        "--refit": "Refit and distillation",
        "--distill-epochs": "Refit and distillation",
        "--kv-codec": "Codecs and cache budget",
        "--kv-budget": "Codecs and cache budget",
        "--output": "Output",
        "--overwrite": "Output",
    }
    assert {flag: where[flag] for flag in expected} == expected


def test_errors_name_the_running_commands_own_options_as_flags():
    """A command's own option (not a Plan field) is named by its flag in an error: the flags come from the running
    command's context, on the click that typer runs commands on."""
    import typer
    from typer.testing import CliRunner

    from kvrewrite.cli import app as cli_app

    probe = typer.Typer()
    seen = {}

    @probe.command()
    def command(new_tokens: int = typer.Option(1, "--new-tokens")) -> None:
        seen.update(cli_app._flags())

    result = CliRunner().invoke(probe, ["--new-tokens", "3"])
    assert result.exit_code == 0, result.output
    assert seen["new_tokens"] == "--new-tokens"


def command_params(name: str) -> dict:
    import typer.main

    return {p.name: p for p in typer.main.get_command(app).commands[name].params}


# Flags both compile commands take: one meaning and one default (issue 37; docs/cli.md's shared table).
SHARED_FLAGS = (
    "--calib-tokens",
    "--distill-tokens",
    "--dtype",
    "--device",
    "--verify-tokens",
    "--refit",
    "--distill-epochs",
)


@pytest.mark.parametrize("flag", SHARED_FLAGS)
def test_shared_flags_have_one_default_in_both_commands(flag):
    import dataclasses

    from kvrewrite.compile.mla.plan import MLAPlan

    def by_flag(params: dict):
        return next(p for p in params.values() if flag in p.opts)

    compress, export = by_flag(command_params("compress")), by_flag(command_params("export-mla"))
    assert compress.default == export.default, (flag, compress.default, export.default)
    # And the plans behind them agree (the commands' defaults are the plans', never restated).
    field = flag.removeprefix("--").replace("-", "_")
    plan = {f.name: f.default for f in dataclasses.fields(Plan)}
    mla = {f.name: f.default for f in dataclasses.fields(MLAPlan)}
    mla_default = "auto" if field == "refit" and mla[field] is None else mla[field]  # MLAPlan: None means auto
    assert plan[field] == mla_default, (field, plan[field], mla[field])
    assert {
        "--calib-tokens": 32768,
        "--distill-tokens": None,
        "--dtype": "auto",
        "--device": "cpu",
        "--verify-tokens": 512,
        "--refit": "auto",
        "--distill-epochs": None,
    }[flag] == compress.default


def test_every_flag_both_commands_take_has_one_default(tmp_path):
    """Not only the table's: every flag compress and export-mla both take has compress's default in export-mla too,
    shown the same, or None (or an empty list) there that MLAPlan resolves to compress's Plan default."""
    import dataclasses

    from kvrewrite.compile.mla.plan import MLAPlan

    def by_flag(name: str) -> dict:
        return {o: p for p in command_params(name).values() if not p.hidden for o in p.opts if o.startswith("--")}

    compress, export = by_flag("compress"), by_flag("export-mla")
    shared = sorted(set(compress) & set(export))
    assert set(SHARED_FLAGS) | {"--serve-rates", "--serve-rates-by", "--distill-lr", "--refit-tokens"} <= set(shared)
    plan = {f.name: f.default for f in dataclasses.fields(Plan)}
    # What export-mla's plan hands the statistics, refit and distillation passes when nothing is given.
    resolved = MLAPlan(output=tmp_path / "out", distill=True).statistics_plan("m")
    for flag in shared:
        a, b = compress[flag].default, export[flag].default
        if a == b or {a, b} == {"", None}:  # '' (compress) and None (export-mla): no rates
            continue
        field = compress[flag].name
        assert b is None and getattr(resolved, field) == plan[field] == a, (flag, a, b)


def test_export_mla_takes_layer_widths_and_refuses_allocation(tmp_path):
    """export-mla's latent widths across layers are --layer-widths: --allocation is compress's (a rank-allocation
    algorithm), so export-mla refuses it naming the new flag, before anything is loaded."""
    params = command_params("export-mla")
    widths = next(p for p in params.values() if "--layer-widths" in p.opts)
    assert widths.default == "uniform" and "--allocation" not in widths.opts
    assert all(p.hidden for p in params.values() if "--allocation" in p.opts)
    result = runner.invoke(
        app, ["export-mla", "no-such-model", "-o", str(tmp_path / "out"), "--allocation", "sensitivity"]
    )
    assert result.exit_code == 2
    assert "--layer-widths sensitivity" in flat(result.output) and not (tmp_path / "out").exists()
    # The plan's field is `layer_widths`, and its message is printed as the command's flag, before anything is loaded.
    from kvrewrite.cli.export import _flags

    assert _flags()["layer_widths"] == "--layer-widths" and "allocation" not in _flags()
    result = runner.invoke(
        app, ["export-mla", "no-such-model", "-o", str(tmp_path / "out"), "--layer-widths", "greedy"]
    )
    assert result.exit_code == 2
    assert "--layer-widths must be uniform or sensitivity, got 'greedy'" in flat(result.output)
    assert not (tmp_path / "out").exists()


def test_export_mla_refuses_a_device_it_cannot_run_on_before_anything_is_loaded(tmp_path):
    """--device is checked as compress checks it (the plan's field names the flag), before any weight is read."""
    for device, message in [("tpu", "--device must be cpu or cuda")] + (
        [] if torch.cuda.is_available() else [("cuda", "--device cuda was asked for but torch sees no CUDA device")]
    ):
        result = runner.invoke(app, ["export-mla", "no-such-model", "-o", str(tmp_path / "out"), "--device", device])
        assert result.exit_code == 2 and message in flat(result.output), flat(result.output)
        assert not (tmp_path / "out").exists()


def test_export_mla_errors_from_the_source_config_name_its_flags(tmp_path):
    """The widths a share leaves are checked by kvrewrite.export_mla once it has read the source's config; its message
    names the MLAPlan field (`kv_share=0.05`), which the command line prints as its flag, and nothing is written."""
    source = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    result = runner.invoke(app, ["export-mla", str(source), "-o", str(out), "--kv-share", "0.05"])
    assert result.exit_code == 2
    assert "--kv-share 0.05 keeps" in flat(result.output) and "`" not in flat(result.output)
    result = runner.invoke(
        app, ["export-mla", str(source), "-o", str(out), "--kv-lora-rank", "8", "--qk-rope-head-dim", "3"]
    )
    assert result.exit_code == 2
    assert "--qk-rope-head-dim must be head_dim" in flat(result.output) and not out.exists()


def test_dtype_auto_is_the_sources_when_float32_or_bfloat16():
    assert Plan(model="x").dtype == "auto"
    for declared, resolved in (
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        ({"dtype": "float32"}, torch.float32),
        ({"dtype": "float16"}, torch.float32),  # float16: float32
        ({}, torch.float32),  # undeclared: float32
    ):
        assert Plan(model="x").compute_dtype(declared) == resolved, declared
    # An explicit dtype is the dtype, whatever the source's.
    assert Plan(model="x", dtype="bf16").compute_dtype({"dtype": "float32"}) == torch.bfloat16
    assert Plan(model="x", dtype="float32").compute_dtype({"dtype": "bfloat16"}) == torch.float32


def test_distill_tokens_default_to_every_calibration_token():
    plan = Plan(model="x", distill=True)
    assert plan.distill_tokens is None and plan.distill_token_count(4096) == 4096
    assert Plan(model="x", distill=True, distill_tokens=1024).distill_token_count(4096) == 1024
