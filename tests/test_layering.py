"""The import graph reads top to bottom: every project module imports only from its own layer or the layers
below it, and no two modules import each other, directly or round a cycle.

Imports inside functions count as much as those at the top of a file: a lazy import that climbs a layer
is still a dependency. The layers, bottom first, are the ones in DESIGN.md and in each package's
docstring; a new module must be placed in one of them (the test names an unplaced module).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module belongs to the layer of the longest prefix that names it ("parallel.zero" covers
# parallel/zero/*; "parallel.comm" is one file).
LAYERS: List[Tuple[str, List[str]]] = [
    ("config: the typed schema and its validation", ["config"]),
    ("kernels and data: quantization references, their fast CPU and Triton twins; tokenizers, indexed datasets",
     ["kernels", "data"]),
    ("parallel primitives: launch, restarts, layout, mesh, the communication door, hang watch, RNG, schedules, "
     "pipeline",
     ["parallel.launch", "parallel.restart", "parallel.layout", "parallel.mesh", "parallel.comm", "parallel.hang",
      "parallel.random", "parallel.schedule", "parallel.pipeline"]),
    ("FP8 numerics: formats, scaling state, FP8 GEMMs (linears, experts), FP8 gradient communication, FP8 AdamW, "
     "device check",
     ["fp8.format", "fp8.segments", "fp8.scaling", "fp8.linear", "fp8.experts", "fp8.grad_comm", "fp8.adam",
      "fp8.device"]),
    ("parallel layers and shared gradient rules: TP/SP linears, vocab-parallel cross entropy, optimizer rules, "
     "16-bit CPU GEMMs, the MoE token exchange, context-parallel attention (ring, all-gather, all-to-all)",
     ["parallel.tensor_parallel", "parallel.cross_entropy", "parallel.optim_rules", "parallel.cpu_gemm",
      "parallel.expert_parallel", "parallel.context", "parallel.ulysses", "parallel.context_mask", "optimizers"]),
    ("model: the GPT from parallel-aware layers, its FLOPs, Hugging Face mapping", ["model"]),
    ("data-parallel strategies and accounting: stage 0, ZeRO 1-3 and ZeRO++, FP8-LM's ZeRO, analytic bytes",
     ["parallel.data_parallel", "parallel.zero", "fp8.zero", "fp8.zero_unit", "fp8.zero_checkpoint",
      "fp8.zero_weights", "parallel.volume", "optimizers.tensor_rules"]),
    ("training: engine, loop, checkpoints, metrics, memory estimate", ["training"]),
    ("entry points: train.py and scripts/", ["train", "scripts"]),
]
PACKAGES = ("config", "kernels", "data", "parallel", "fp8", "optimizers", "model", "training", "train", "scripts")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> Dict[str, Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".git") or any(p.startswith(".") for p in rel.parts):
            continue
        name = module_name(path)
        if name.split(".")[0] in PACKAGES:
            mods[name] = path
    return mods


def layer_of(module: str) -> int:
    best, where = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), i
    if where is None:
        raise AssertionError(f"module {module} is in no layer: place it in tests/test_layering.py's LAYERS "
                             f"(and in its package's docstring)")
    return where


def imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """Project modules that ``module`` imports anywhere in its file (lazy imports included)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # "from parallel import comm" imports the module parallel.comm
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> Dict[str, Set[str]]:
    mods = project_modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def test_the_graph_sees_what_a_module_imports():
    g = graph()
    # a top-level import, a "from package import module" and a lazy import inside a function
    assert "config" in g["parallel.layout"]
    assert "parallel.comm" in g["fp8.scaling"]
    assert "fp8.zero_unit" in g["training.memory"]
    assert {"training.trainer", "config"} <= g["train"]


def climbing_imports(g: Dict[str, Set[str]]) -> List[str]:
    def short(m: str) -> str:
        return LAYERS[layer_of(m)][0].split(":")[0]
    return [f"{m} ({short(m)}) imports {d} ({short(d)})"
            for m, deps in sorted(g.items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]


def test_every_module_imports_only_its_own_layer_or_below():
    climbs = climbing_imports(graph())
    assert not climbs, "imports that climb a layer:\n  " + "\n  ".join(climbs)


def test_no_module_below_training_imports_training():
    g = graph()
    bad = [f"{m} imports {d}" for m, deps in sorted(g.items()) for d in sorted(deps)
           if m.split(".")[0] not in ("training", "train", "scripts") and d.split(".")[0] == "training"]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    g = graph()
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_a_climbing_import_is_caught():
    """The check itself: a model module that imported the trainer, or a new module placed nowhere, is reported."""
    g = graph()
    g["model.gpt"] = g["model.gpt"] | {"training.trainer"}
    assert climbing_imports(g) == ["model.gpt (model) imports training.trainer (training)"]
    with pytest.raises(AssertionError, match="module misc.helpers is in no layer"):
        layer_of("misc.helpers")
