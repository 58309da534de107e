"""The package's shape, checked without a GPU: no import cycles, the host half free of the engine,
every user-facing error importable without CuPy, and no module that has outgrown one job."""

import ast
import pathlib

import pytest

import glmvit_cupy

PKG = pathlib.Path(glmvit_cupy.__file__).parent


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set:
    """The package modules a file imports, at any depth (inside functions too)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            if target.startswith("glmvit_cupy"):
                for alias in node.names:  # `from . import x` imports the module x
                    out.add(f"{target}.{alias.name}" if (PKG.parent / f"{target}.{alias.name}".replace(
                        ".", "/")).with_suffix(".py").exists() else target)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("glmvit_cupy")}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr):  # __init__'s lazy f".engine.{...}": every engine facade
                out |= {"glmvit_cupy.engine.model", "glmvit_cupy.engine.replicas"}
    return {m for m in out if m != me}


GRAPH = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def reaches(start, goal, graph=GRAPH):
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return False


def test_no_module_imports_one_that_imports_it_back():
    # The package's own __init__ re-exports the host half; a submodule importing the package is no cycle.
    graph = {m: {t for t in ts if t != "glmvit_cupy"} for m, ts in GRAPH.items() if m != "glmvit_cupy"}
    cycles = [(m, t) for m, ts in graph.items() for t in ts if reaches(t, m, graph)]
    assert not cycles, cycles


@pytest.mark.parametrize("host", ["config", "layout", "weights", "checkpoint", "hub", "images", "preprocess", "batching",
                                  "reference", "synthetic", "errors"])
def test_host_half_never_imports_the_engine(host):
    assert not any(m.startswith("glmvit_cupy.engine") for m in GRAPH[f"glmvit_cupy.{host}"] | {
        t for m in GRAPH[f"glmvit_cupy.{host}"] for t in GRAPH.get(m, ())})
    assert not reaches(f"glmvit_cupy.{host}", "glmvit_cupy.engine.model")


def test_errors_importable_without_cupy():
    from glmvit_cupy import (AbsentTower, CheckpointError, GpuOutOfMemory, ImageError, KernelError,  # noqa: F401
                             NoVisionConfig)

    assert issubclass(NoVisionConfig, CheckpointError) and issubclass(ImageError, ValueError)
    assert issubclass(GpuOutOfMemory, MemoryError) and issubclass(KernelError, RuntimeError)
    for p in PKG.rglob("*.py"):  # defined once, in errors.py
        if p.name != "errors.py":
            assert "Error(" not in "".join(ln for ln in p.read_text().splitlines(True) if ln.startswith("class ")), p


def test_no_module_has_outgrown_one_job():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 310}
    assert not long, long
