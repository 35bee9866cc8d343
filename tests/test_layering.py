"""What each package may import (docs/architecture.md, "Packages"), read from the source.

Every ``import`` and ``from ... import`` is counted, at module level or inside a function, so a
lazy import cannot slip past the rule: the table below is the whole dependency graph we allow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("model", "parallel", "data", "ckpt", "train", "eval", "convert", "plan", "planpage")

# unit -> the units it may import (besides itself). A unit is a top-level folder, a moe_core
# subpackage, or a top-level moe_core module.
LEAF = "moe_core.config"
ALLOWED: dict[str, set[str]] = {
    "moe_kernels": set(),
    "moe_core.config": set(),
    "moe_core.config_dict": {LEAF},  # configs as dicts: coercion, moved keys
    "moe_core.files": set(),
    "moe_core.hardware": set(),
    "moe_core.progress": set(),  # a long step's progress lines (the CLI and the flow's stages)
    # init.from_hf: the model section from a checkpoint's config (convert.hf, lazily)
    "moe_core.compose": {LEAF, "moe_core.config_dict", "moe_core.convert"},
    "moe_core.errors": {LEAF, "moe_core.data"},  # refusals() names DataError, lazily
    "moe_core.rundir": {"moe_core.errors"},
    "moe_core.model": {LEAF, "moe_kernels"},
    "moe_core.parallel": {LEAF, "moe_kernels", "moe_core.model"},
    "moe_core.data": {LEAF, "moe_core.files"},
    "moe_core.ckpt": {"moe_core.errors", "moe_core.files"},  # the checkpoint format
    "moe_core.convert": {
        LEAF,
        "moe_core.errors",
        "moe_core.files",
        "moe_core.model",
        "moe_core.data",
        "moe_core.ckpt",
        "moe_core.config_dict",
    },
    "moe_core.eval": {LEAF, "moe_core.model", "moe_core.data", "moe_core.convert"},
    "moe_core.train": {
        LEAF,
        "moe_kernels",
        "moe_core.errors",
        "moe_core.files",
        "moe_core.rundir",
        "moe_core.hardware",
        "moe_core.model",
        "moe_core.parallel",
        "moe_core.data",
        "moe_core.ckpt",
        "moe_core.eval",
        "moe_core.convert",
        "moe_core.config_dict",
    },
    "moe_core.plan": {LEAF, "moe_core.hardware", "moe_core.model", "moe_core.parallel"},
    "moe_core.planpage": {
        LEAF,
        "moe_core.compose",
        "moe_core.hardware",
        "moe_core.model",
        "moe_core.plan",
        "moe_core.config_dict",
    },
}
LIBRARY = {u for u in ALLOWED}  # kernels and moe_core, without the CLI
ALLOWED["moe_core.cli"] = LIBRARY
ALLOWED["moe_core"] = set()  # the package's __init__
ALLOWED["flows"] = LIBRARY | {"moe_core.cli"}
ALLOWED["benchmarks"] = LIBRARY


def unit(module: str) -> str | None:
    """The unit a dotted module name belongs to, or None for a third-party module."""
    parts = module.split(".")
    if parts[0] in ("moe_kernels", "flows", "benchmarks"):
        return parts[0]
    if parts[0] != "moe_core":
        return None
    return "moe_core" if len(parts) == 1 else f"moe_core.{parts[1]}"


def imports(path: Path) -> list[str]:
    """Every absolute module name ``path`` imports, wherever the import statement sits."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def sources() -> dict[str, Path]:
    files = {}
    for top in ("moe_kernels", "moe_core", "flows", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    return files


def test_every_import_between_packages_is_one_the_table_allows():
    assert set(ALLOWED) >= {f"moe_core.{s}" for s in SUBPACKAGES}
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, path in sources().items():
        src = unit(name)
        assert src in ALLOWED, f"{name}: a unit the table does not know ({src})"
        for target in imports(path):
            dst = unit(target)
            if dst is not None and dst != src and dst not in ALLOWED[src]:
                found[(src, dst)].append(f"{name} imports {target}")
    assert not found, "\n".join(line for lines in found.values() for line in lines)


def on_cycle(edges: dict[str, set[str]], start: str) -> bool:
    """Whether ``start`` is reached back from the nodes it points at."""
    seen: set[str] = set()
    todo = list(edges.get(start, ()))
    while todo:
        node = todo.pop()
        if node == start:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return False


def test_no_cycle_among_the_units():
    """The units' import graph, as the source has it, is acyclic: a folder that imports another
    is never reached back from it, also through a third (train -> eval -> convert -> train)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in sources().items():
        src = unit(name)
        edges[src] |= {d for t in imports(path) if (d := unit(t)) is not None and d != src}

    cycles = sorted(u for u in list(edges) if on_cycle(edges, u))
    assert not cycles, f"units on an import cycle: {cycles}"


def module_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ours ``path`` imports, wherever the statement sits: ``from a import b``
    names the module ``a.b`` where ``b`` is one, else ``a``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_no_cycle_among_the_files():
    """No module of kernels, moe_core or flows is reached back from a module it imports (lazy
    imports count: a circle hidden inside a function is still one)."""
    files = {n: p for n, p in sources().items() if unit(n) != "benchmarks"}
    edges = {n: module_imports(p, set(files)) - {n} for n, p in files.items()}

    cycles = sorted(n for n in edges if on_cycle(edges, n))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_library_never_imports_the_orchestration_and_only_compose_imports_hydra():
    for name, path in sources().items():
        tops = {m.split(".")[0] for m in imports(path)}
        if unit(name) in LIBRARY | {"moe_core.cli"}:
            assert not tops & {"prefect", "prefect_kubernetes"}, f"{name} imports Prefect"
        if name != "moe_core.compose":
            assert not tops & {"hydra", "omegaconf"}, f"{name} imports Hydra/OmegaConf"


def test_importing_the_library_and_building_a_model_do_not_import_torchdynamo():
    """TorchDynamo costs about 2 s per process that imports it: only compiling loads it
    (``model.eager``), not importing the trainer or the CLI (every rank of a launch does), nor
    building a model on the meta device and planning it (``model.meta.on_meta``: PyTorch's fill
    of a meta tensor would import it)."""
    code = (
        "import sys, moe_core.cli, moe_core.train.trainer, flows.pretrain; "
        "from moe_core.compose import compose_run; from moe_core.plan import plan; "
        "from moe_core.model import build_model; from moe_core.model.flops import count; "
        "run = compose_run(['model=tiny']); plan(run); count(run.model, 64); "
        "build_model(run.model, 'cpu'); "
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
