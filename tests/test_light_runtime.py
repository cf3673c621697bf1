"""`import kvrewrite` is the runtime only: a fresh interpreter in which gensim, scikit-learn and matplotlib cannot be
imported loads compressed checkpoints, runs them bit-identically to this process, and never imports the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("gensim", "sklearn", "matplotlib")  # the `compile` extra, by import name
COMPILER = ("kvrewrite.compile", "kvrewrite.publish")  # the whole compiler, and evaluation, cards and plots

# Run with `python -c`: a None entry in sys.modules is what an uninstalled package looks like to both
# `import x` (ModuleNotFoundError) and importlib.util.find_spec (None), so no optional-import probe is fooled.
BLOCK = "import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"

CHILD = (
    BLOCK
    + r"""
import json
import torch
torch.set_num_threads({threads})

import kvrewrite
# The rest of the runtime, imported whole: token tiers, KV codecs, kernels, the old Llama stub's module.
import kvrewrite.runtime.codecs, kvrewrite.runtime.codecs.checkpoint, kvrewrite.runtime.kernels, kvrewrite.modeling.llama
import kvrewrite.runtime.tiers, kvrewrite.runtime.tiers.attention, kvrewrite.runtime.tiers.token_policy_file, kvrewrite.runtime.tiers.build, kvrewrite.runtime.tiers.eviction, kvrewrite.runtime.cache_bytes
import kvrewrite.runtime.cache_policy, kvrewrite.runtime.cache_forms
from transformers import AutoModelForCausalLM

tokens = torch.load({tokens!r})
out = {{}}
for name, directory in {checkpoints!r}.items():
    for how, model in (("load", kvrewrite.load(directory)),
                       ("auto", AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32))):
        model.eval()
        with torch.no_grad():
            one_shot = model(tokens).logits
            # Prefill then decode through the model's own cache (the codec cache for a codec checkpoint).
            prefill = model(tokens[:, :20], use_cache=True)
            step = model(tokens[:, 20:21], past_key_values=prefill.past_key_values, use_cache=True).logits
        out[f"{{name}}/{{how}}"] = {{"one_shot": one_shot, "step": step}}
torch.save(out, {result!r})
loaded = {{name: repr(module) for name, module in sys.modules.items()
          if name.partition(".")[0] in {blocked!r} and module is not None}}
compiler = sorted(name for name in sys.modules
                  if any(name == c or name.startswith(c + ".") for c in {compiler!r}))
print(json.dumps({{"blocked_loaded": loaded, "compiler_loaded": compiler}}))
"""
)


def _run_child(code: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("light")
    src = save_tiny_llama(root / "src", seed=5, num_kv_heads=2, num_heads=4)
    out = {}
    # The default key mode (latent) and the zero-overhead one (freq), the latter with a KV codec on top.
    for name, options in {
        "latent": {},
        "freq-int4": {"rope_mode": "freq", "kv_codec": "int4", "allocation": "uniform"},
    }.items():
        plan = Plan(model=str(src), output=root / name, progress=False, target_rate=0.5, **options)
        run_pipeline(plan, tiny_pipeline())
        out[name] = root / name
    return out


def test_runtime_loads_and_runs_without_the_compile_extra(checkpoints, tmp_path):
    tokens = random_windows(n=2, length=32, seed=7)
    torch.save(tokens, tmp_path / "tokens.pt")
    code = CHILD.format(
        blocked=BLOCKED,
        compiler=COMPILER,
        threads=torch.get_num_threads(),
        tokens=str(tmp_path / "tokens.pt"),
        checkpoints={k: str(v) for k, v in checkpoints.items()},
        result=str(tmp_path / "logits.pt"),
    )
    done = _run_child(code)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["blocked_loaded"] == {}
    assert seen["compiler_loaded"] == []

    child = torch.load(tmp_path / "logits.pt")
    assert set(child) == {f"{name}/{how}" for name in checkpoints for how in ("load", "auto")}
    for name, directory in checkpoints.items():
        model = kvrewrite.load(directory).eval()
        with torch.no_grad():
            one_shot = model(tokens).logits
            prefill = model(tokens[:, :20], use_cache=True)
            step = model(tokens[:, 20:21], past_key_values=prefill.past_key_values, use_cache=True).logits
        for how in ("load", "auto"):
            assert torch.equal(child[f"{name}/{how}"]["one_shot"], one_shot), f"{name}/{how}"
            assert torch.equal(child[f"{name}/{how}"]["step"], step), f"{name}/{how}"


def test_the_block_really_hides_the_packages():
    """The stand-in for 'not installed' works: importing any of them fails, and find_spec sees nothing."""
    code = BLOCK.format(blocked=BLOCKED) + (
        "import importlib, importlib.util\n"
        "for name in " + repr(BLOCKED) + ":\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{name} imported')\n"
    )
    done = _run_child(code)
    assert done.returncode == 0, done.stderr[-2000:]


def test_compile_commands_name_the_extra_when_it_is_missing(checkpoints, tmp_path):
    cli = BLOCK.format(blocked=BLOCKED) + "from kvrewrite.cli.app import main\nsys.argv = {argv!r}\nmain()\n"
    # compress with the default wiki calibration needs gensim only (tests/test_optional_dependencies.py: synthetic
    # needs none); sweep evaluates on wiki text and plots.
    for argv, needs in (
        (
            ["kvrewrite", "compress", str(checkpoints["latent"].parent / "src"), "-o", str(tmp_path / "out")],
            "needs gensim, which is not installed",
        ),
        (
            ["kvrewrite", "sweep", str(checkpoints["latent"].parent / "src"), "-o", str(tmp_path / "sweep")],
            "needs gensim, matplotlib, which are not installed",
        ),
    ):
        done = _run_child(cli.format(argv=argv))
        text = " ".join((done.stdout + done.stderr).split())  # rich wraps long lines
        assert done.returncode == 2, text[-2000:]
        assert "pip install 'kvrewrite[compile]'" in text and needs in text, text[-2000:]
        assert "Traceback" not in text
    assert not (tmp_path / "out").exists() and not (tmp_path / "sweep").exists()
    # Loading and inspecting need none of it (inspect only skips its heat map, with a warning).
    done = _run_child(cli.format(argv=["kvrewrite", "inspect", str(checkpoints["latent"])]))
    text = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, text[-2000:]
    assert "no heat map written: it needs matplotlib (pip install 'kvrewrite[compile]')" in text
