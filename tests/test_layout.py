"""The package's layering, read from its source (tools/import_graph.py): no circles between top-level folders or
between files, the runtime never reaches into the compiler, the maths imports no infrastructure, nothing imports
the CLI."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from import_graph import (  # noqa: E402
    CLI_ENTRY_POINTS,
    cli_imports,
    cycles,
    folder_edges,
    module_cycles,
    module_edges,
)

# What each folder may import (besides itself). Anything else is a wrong-way arrow.
ALLOWED = {
    "errors": set(),
    "spec": {"errors"},
    "progress": set(),
    "extras": {"errors"},
    "adapters": {"errors", "spec"},
    "method": {"errors", "spec", "adapters", "progress"},
    "io": {"errors", "spec", "adapters"},
    # One class per key mode: its maths (method), what it folds and what the runtime does with it.
    "key_modes": {"errors", "spec", "adapters", "method"},
    "runtime": {"errors", "spec", "adapters", "io", "key_modes"},
    "modeling": {"runtime"},
    "publish": {"errors", "spec", "extras", "io", "runtime", "progress", "key_modes"},
    "compile": {"errors", "spec", "extras", "io", "runtime", "method", "adapters", "progress", "publish", "key_modes"},
    "cli": {
        "errors",
        "spec",
        "extras",
        "io",
        "runtime",
        "method",
        "adapters",
        "progress",
        "publish",
        "compile",
        "key_modes",
        "interrupts",
    },
    "interrupts": set(),
    "kvrewrite": {"runtime", "spec", "interrupts"},
}


def test_no_import_circles_between_folders():
    assert cycles(folder_edges()) == []


def test_every_arrow_points_down():
    wrong = {edge: pairs for edge, pairs in folder_edges().items() if edge[1] not in ALLOWED.get(edge[0], set())}
    assert wrong == {}


def test_the_graph_sees_a_known_arrow():
    """Guards the reader itself: an arrow that exists must be found (an empty graph would pass the tests above)."""
    edges = folder_edges()
    assert "kvrewrite.runtime.checkpoint_files -> kvrewrite.io.lazy_checkpoint" in edges[("runtime", "io")]
    assert ("compile", "method") in edges


def test_no_import_circles_between_files():
    """No two modules import each other, directly or around a loop (lazy imports count: a lazy import that closes a
    circle only hides it; imports under `if TYPE_CHECKING:` never run and do not count)."""
    assert module_cycles(module_edges()) == []


def test_the_file_graph_sees_known_arrows_and_finds_a_circle():
    """Guards the file-level reader: real arrows (a lazy one included) are found, a type-checking-only import is not,
    and a circle in a graph is reported."""
    edges = module_edges()
    assert "kvrewrite.runtime.checkpoint_files" in edges["kvrewrite.runtime.load"]
    assert "kvrewrite.runtime.checkpoint_files" in edges["kvrewrite.runtime.modeling.families"]  # inside a method
    assert "kvrewrite.runtime.codecs.registry" in edges["kvrewrite.runtime.codecs.config"]
    assert "kvrewrite.runtime.codecs.base" not in edges["kvrewrite.runtime.codecs.registry"]  # TYPE_CHECKING only
    assert module_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_outside_the_command_line_imports_from_it():
    """Library code never lives in kvrewrite/cli/. The rule, for every .py file outside kvrewrite/cli/:
    - in the package (kvrewrite/): no import of kvrewrite.cli at all;
    - in tests/, benchmarks/, tools/ and docs/: only the entry points `app` and `main` of kvrewrite.cli.app, which run
      the command line as a user does (typer's CliRunner, or main() with sys.argv);
    - the command line's own tests (tests/test_cli*.py) may import its internals (its option table, its parsers).
    Running the CLI in a subprocess (`python -m kvrewrite.cli.app ...`) is not an import and is always allowed."""
    wrong = []
    for path, module, names in cli_imports():
        own_test = Path(path).parent.name == "tests" and Path(path).name.startswith("test_cli")
        entry_point = (
            module == "kvrewrite.cli.app"
            and names
            and set(names) <= CLI_ENTRY_POINTS
            and not path.startswith("kvrewrite/")
        )
        if not (own_test or entry_point):
            wrong.append(f"{path}: from {module} import {', '.join(names) or '*'}")
    assert wrong == []


def test_the_cli_import_reader_sees_known_imports():
    """Guards the reader: the CLI tests' imports of its internals and another test's import of `app` are found."""
    found = cli_imports()
    assert ("tests/test_cli_and_errors.py", "kvrewrite.cli.compress_options", ("PLAN_FLAGS", "cli_message")) in found
    assert ("tests/test_hub.py", "kvrewrite.cli.app", ("app",)) in found


def _names_imported(folder: Path) -> set[tuple[str, str, str]]:
    """(file, module, name) for every `from module import name` under folder, lazy imports included."""
    import ast

    found = set()
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {(path.name, node.module, alias.name) for alias in node.names}
    return found


def test_the_command_line_runs_both_compilers_through_their_apis():
    """`compress` and `export-mla` call kvrewrite.compress and kvrewrite.export_mla: no file of kvrewrite/cli/ runs
    the pipelines itself (their runners are the APIs' insides)."""
    found = _names_imported(Path(__file__).resolve().parent.parent / "kvrewrite" / "cli")
    assert ("app.py", "kvrewrite.compile.api", "compress") in found
    assert ("export.py", "kvrewrite.compile.mla.api", "export_mla") in found
    runners = {"run_pipeline", "run_pass", "run_mla_export", "run_mla_passes", "compile_variants"}
    assert sorted(entry for entry in found if entry[2] in runners) == []
    assert ("demo.py", "kvrewrite.compile.api", "compress_variants") in found


def test_benchmarks_compile_through_the_api():
    """Benchmarks compile with kvrewrite.compress / compress_variants / export_mla, never the pipeline runners; the
    one exception runs the tests' own fixed-calibration pipeline (fault_table.py, the checkpoint test_faults builds)."""
    found = _names_imported(Path(__file__).resolve().parent.parent / "benchmarks")
    runners = {"run_pipeline", "run_pass", "run_mla_export", "run_mla_passes", "compile_variants"}
    assert sorted(entry for entry in found if entry[2] in runners) == [
        ("fault_table.py", "kvrewrite.compile.passes.pipeline", "run_pipeline")
    ]


def test_published_checkpoint_stub_paths_still_import():
    """Checkpoints on the Hub carry a modeling_kvrewrite.py stub that imports kvrewrite.modeling.families (format-1
    ones: kvrewrite.modeling.llama); the layout may move, those paths must keep giving the registered classes."""
    from kvrewrite.compile.passes.emit import HUB_MODELING_STUB
    from kvrewrite.modeling import families as stable_families
    from kvrewrite.modeling.llama import KVRewriteLlamaForCausalLM
    from kvrewrite.runtime.modeling.families import COMPRESSED_FAMILIES

    assert "from kvrewrite.modeling.families import" in HUB_MODELING_STUB
    for config_class, model_class in COMPRESSED_FAMILIES.values():
        assert getattr(stable_families, config_class.__name__) is config_class
        assert getattr(stable_families, model_class.__name__) is model_class
    assert KVRewriteLlamaForCausalLM is COMPRESSED_FAMILIES["kvrewrite_llama"][1]
