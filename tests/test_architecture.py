"""The import layers of docs/architecture.md, checked against every import in
the code (module level and function level): what runs in the training process
imports nothing of the launcher, sidecar or commands; the sidecar imports
nothing of the launcher; neither imports the trainer; nothing imports in a
cycle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "trainwatch"

# What each part may import (besides itself); see docs/architecture.md.
BASE = {"trainwatch.slots", "trainwatch.env", "trainwatch.flags", "trainwatch.usage", "trainwatch.historyfile",
        "trainwatch.checkpoint", "trainwatch.finite", "trainwatch.ckptschema", "trainwatch.diagnostics",
        "trainwatch.procctl", "trainwatch.netbind", "trainwatch.kinds", "trainwatch.records", "trainwatch.codec",
        "trainwatch.rankrow", "trainwatch.messages"}
LEVEL2 = BASE | {"trainwatch.state", "trainwatch.capture", "trainwatch.liveness",
                 "trainwatch.jobstore", "trainwatch"}
ALLOWED = {
    "trainwatch.diagnostics": {"trainwatch.diagnostics", "trainwatch.slots", "trainwatch.kinds", "trainwatch.codec",
                               "trainwatch.records", "trainwatch.rankrow"},
    "trainwatch.kinds": set(),
    "trainwatch.records": {"trainwatch.codec", "trainwatch.kinds"},
    "trainwatch.codec": set(),
    "trainwatch.messages": set(),
    "trainwatch.slots": set(),
    "trainwatch.env": set(),
    "trainwatch.flags": set(),
    "trainwatch.usage": set(),
    "trainwatch.historyfile": set(),
    "trainwatch.finite": set(),
    "trainwatch.checkpoint": {"trainwatch.finite", "trainwatch.ckptschema"},
    "trainwatch.ckptschema": set(),
    "trainwatch.procctl": set(),
    "trainwatch.netbind": set(),
    "trainwatch.jobstore": {"trainwatch.env"},
    "trainwatch.liveness": BASE | {"trainwatch.state"},
    "trainwatch.rankrow": {"trainwatch.codec", "trainwatch.slots"},
    "trainwatch.state": BASE,
    "trainwatch.capture": BASE | {"trainwatch.state"},
    "trainwatch.inject": LEVEL2 | {"trainwatch.inject"},
    "trainwatch.rank": LEVEL2 | {"trainwatch.inject", "trainwatch.rank"},
    "trainwatch.trainer": LEVEL2 | {"trainwatch.inject", "trainwatch.rank", "trainwatch.trainer"},
    "trainwatch.views": LEVEL2 | {"trainwatch.views"},
    "trainwatch.watchdog": LEVEL2 | {"trainwatch.inject", "trainwatch.watchdog"},
    "trainwatch.launcher": LEVEL2 | {"trainwatch.inject", "trainwatch.views", "trainwatch.launcher",
                                     *(f"trainwatch.watchdog.{m}" for m in ("config", "checkpointing", "rankexit",
                                                                            "nvml"))},
}
# What of the sidecar a launch loads: its typed config, never its machinery.
SIDECAR_MACHINERY = ("trainwatch.watchdog.detectors", "trainwatch.watchdog.engine", "trainwatch.watchdog.responder",
                     "trainwatch.watchdog.exporter", "trainwatch.watchdog.sidecar")
PROCESS_MODULES = {"subprocess", "multiprocessing", "psutil", "concurrent", "threading"}


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, name: str) -> set[str]:
    """Every module imported anywhere in the file (function-local imports included)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def owner(name: str) -> str:
    """The layer a module belongs to (the longest key of ALLOWED it starts with)."""
    keys = [k for k in ALLOWED if name == k or name.startswith(k + ".")]
    return max(keys, key=len) if keys else name


def internal(targets: set[str], known: dict[str, Path]) -> set[str]:
    """The trainwatch modules among imported names (a name may be a module or something in one)."""
    out = set()
    for t in targets:
        if not t.startswith("trainwatch"):
            continue
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t:
            out.add(t)
    return out


def test_every_import_respects_the_layers():
    known = modules()
    bad = []
    for name, path in known.items():
        layer = owner(name)
        if layer not in ALLOWED:
            continue
        for target in internal(imports(path, name), known):
            if target in (name, "trainwatch") or owner(target) == layer:
                continue
            allowed = ALLOWED[layer]
            if not any(target == a or target.startswith(a + ".") or owner(target) == a for a in allowed):
                bad.append(f"{name} -> {target}")
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(sorted(bad))


def test_rank_side_never_imports_launcher_sidecar_or_commands():
    known = modules()
    forbidden = ("trainwatch.watchdog", "trainwatch.launcher", "trainwatch.views", "trainwatch.cli",
                 "trainwatch.dashboards")
    for name, path in known.items():
        if owner(name) in ("trainwatch.rank", "trainwatch.inject", "trainwatch.trainer"):
            leaks = [t for t in internal(imports(path, name), known) if t.startswith(forbidden)]
            assert not leaks, f"{name} imports {leaks}"


def test_launcher_imports_no_detector():
    """Launching loads the watchdog's typed config (its flags are generated from
    it), never the detectors or the rest of the sidecar: checked in a fresh
    interpreter, after importing every module of the launcher."""
    probe = ("import pkgutil, importlib, sys, trainwatch.launcher as l\n"
             "for m in pkgutil.iter_modules(l.__path__): importlib.import_module('trainwatch.launcher.' + m.name)\n"
             "print(' '.join(sorted(m for m in sys.modules if m.startswith('trainwatch'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    assert "trainwatch.launcher.launch" in loaded and "trainwatch.launcher.agent" in loaded
    leaks = [m for m in loaded if m.startswith(SIDECAR_MACHINERY)]
    assert not leaks, f"the launcher imports the sidecar's {leaks}"


def test_diagnostics_run_no_process():
    for path in (PKG / "diagnostics").glob("*.py"):
        names = {n.split(".")[0] for n in imports(path, "trainwatch.diagnostics." + path.stem)}
        assert not names & PROCESS_MODULES, f"{path.name} imports {names & PROCESS_MODULES}"


def test_no_import_cycles():
    known = modules()
    graph = {name: internal(imports(path, name), known) - {name} for name, path in known.items()}
    # A package's __init__ importing its submodules is not a cycle with them.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_architecture_doc_lists_every_folder_and_shared_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `(trainwatch/[^`]+)` \|", doc, re.M))
    folders = {f"trainwatch/{p.name}/" for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    shared = {f"trainwatch/{p.name}" for p in PKG.glob("*.py") if p.stem not in ("__init__", "cli")}
    assert listed == folders | shared, (sorted(folders | shared - listed), sorted(listed - folders - shared))


def test_no_module_is_too_long_to_read():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 460}
    assert not long, long
