"""The import graph of kvrewrite's top-level folders, read from the source (every import, lazy ones included).

`python tools/import_graph.py` prints each folder's arrows and any circle (between folders or between files) and
draws docs/images/import_graph.png; tests/test_layout.py uses `folder_edges`, `module_edges` and `cli_imports` to
hold the layering rules (no circles, nothing from the runtime into the compiler, nothing imported from the CLI).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvrewrite"

# Drawing order, bottom (imports nothing of ours) to top (the user-facing entry points).
LAYERS = [
    ["errors", "spec", "progress", "extras"],
    ["adapters"],
    ["io", "method"],
    ["key_modes"],
    ["runtime", "modeling"],
    ["publish", "compile"],
    ["cli"],
]


def folder_of(module: str) -> str:
    """'kvrewrite.runtime.tiers.cache' -> 'runtime'; 'kvrewrite.errors' -> 'errors'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvrewrite"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every kvrewrite module a file imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("kvrewrite")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvrewrite"):
            found.add(node.module)
            if node.module == "kvrewrite":  # `from kvrewrite import io` may name a subpackage
                found |= {
                    f"kvrewrite.{alias.name}"
                    for alias in node.names
                    if (PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").is_file()
                }
    return found


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """(from folder, to folder) -> the 'importer -> imported' module pairs behind that arrow."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for imported in sorted(imported_modules(path)):
            a, b = folder_of(importer), folder_of(imported)
            if a != b and b != "kvrewrite":
                edges[(a, b)].append(f"{importer} -> {imported}")
    return dict(edges)


def _executed_nodes(tree: ast.AST):
    """Every node of a module except the bodies of `if TYPE_CHECKING:` (imports for annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for other in node.orelse:
                yield other
                yield from _executed_nodes(other)
            continue
        yield node
        yield from _executed_nodes(node)


def module_edges() -> dict[str, set[str]]:
    """File-level arrows: module -> the kvrewrite modules it imports when it runs, lazy imports included and imports
    under `if TYPE_CHECKING:` left out (`from pkg import name` counts as pkg.name when that is a module of ours, else
    as pkg, i.e. its __init__)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for importer, path in modules.items():
        for node in _executed_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                ]
            else:
                continue
            edges[importer] |= {t for t in targets if t in modules and t != importer}
    return edges


def module_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Files that import each other, directly or around a loop, lazy imports included (each strongly connected
    group of two or more modules, sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


# Outside kvrewrite/cli/ the command line is only run, never imported from: these are its entry points.
CLI_ENTRY_POINTS = {"app", "main"}


def cli_imports() -> list[tuple[str, str, tuple[str, ...]]]:
    """Every import of kvrewrite.cli from outside kvrewrite/cli/ (the package, tests, benchmarks, tools, docs
    examples), as (file relative to the repository, module, names imported; () for a plain `import`)."""
    root = PACKAGE.parent
    files = [
        p
        for folder in ("kvrewrite", "tests", "benchmarks", "tools", "docs")
        for p in (root / folder).rglob("*.py")
        if (PACKAGE / "cli") not in p.parents
    ]
    found = []
    for path in sorted(files):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found += [
                    (str(path.relative_to(root)), alias.name, ())
                    for alias in node.names
                    if alias.name == "kvrewrite.cli" or alias.name.startswith("kvrewrite.cli.")
                ]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = tuple(alias.name for alias in node.names)
                if node.module == "kvrewrite.cli" or node.module.startswith("kvrewrite.cli."):
                    found.append((str(path.relative_to(root)), node.module, names))
                elif node.module == "kvrewrite" and "cli" in names:
                    found.append((str(path.relative_to(root)), "kvrewrite.cli", ()))
    return found


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Folder-level circles (each as a path that returns to its start)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def draw(edges: dict[tuple[str, str], list[str]], out: Path) -> None:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    del matplotlib
    position = {}
    for y, row in enumerate(LAYERS):
        for x, name in enumerate(row):
            position[name] = ((x + 1) / (len(row) + 1), 0.06 + y * 0.88 / (len(LAYERS) - 1))
    fig = Figure(figsize=(8, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    for (a, b), pairs in sorted(edges.items()):
        if a not in position or b not in position:
            continue
        (x0, y0), (x1, y1) = position[a], position[b]
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops=dict(
                arrowstyle="-|>",
                color="0.8" if b in ("errors", "progress") else "0.4",
                shrinkA=22,
                shrinkB=22,
                connectionstyle="arc3,rad=0.08",
                lw=0.6 + 0.25 * min(len(pairs), 8),
            ),
        )
    for name, (x, y) in position.items():
        files = len(list((PACKAGE / name).rglob("*.py"))) if (PACKAGE / name).is_dir() else 1
        ax.text(
            x,
            y,
            f"{name}/\n{files} files" if (PACKAGE / name).is_dir() else f"{name}.py",
            ha="center",
            va="center",
            fontsize=10,
            bbox=dict(boxstyle="round", fc="#e8f0fe", ec="#3367d6"),
        )
    ax.set_title("kvrewrite: imports between top-level folders (arrow width ~ module pairs)", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> int:
    edges = folder_edges()
    for (a, b), pairs in sorted(edges.items()):
        print(f"{a:>9} -> {b:<9} {len(pairs):3d} imports")
    loops = cycles(edges)
    for loop in loops:
        print("circle:", " -> ".join(loop))
    file_loops = module_cycles(module_edges())
    for group in file_loops:
        print("files importing each other:", ", ".join(group))
    print(f"{len(loops)} circles between folders, {len(file_loops)} between files")
    draw(edges, PACKAGE.parent / "docs" / "images" / "import_graph.png")
    return 1 if loops or file_loops else 0


if __name__ == "__main__":
    sys.exit(main())
