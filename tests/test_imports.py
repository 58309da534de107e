"""The package's import graph, checked without a GPU: no import cycles, the host half free of the engine
(and of CuPy), every public name importable where the docs say, every user-facing error defined once."""

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys

import pytest

import glmvit_cupy

PKG = pathlib.Path(glmvit_cupy.__file__).parent


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    p = PKG.parent / dotted.replace(".", "/")
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


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
                out.add(target)
                for alias in node.names:  # `from . import x` imports the module x
                    if is_module(f"{target}.{alias.name}"):
                        out.add(f"{target}.{alias.name}")
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("glmvit_cupy")}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr):  # __init__'s lazy f".engine.{...}" and f".{name}"
                out |= {f"glmvit_cupy.engine.{m}" for m in glmvit_cupy._ENGINE.values()}
    return {m for m in out if m != me}


GRAPH = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}
BACKEND = "glmvit_cupy.backend"
HOST = sorted(m for m in GRAPH if m != "glmvit_cupy" and not m.startswith("glmvit_cupy.engine"))


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
    # A package's __init__ re-exports its modules; a module importing its own package is no cycle.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in GRAPH.items()
             if not (PKG.parent / m.replace(".", "/") / "__init__.py").exists()}
    cycles = [(m, t) for m, ts in graph.items() for t in ts if t in graph and reaches(t, m, graph)]
    assert not cycles, cycles


def test_the_graph_sees_the_sub_packages():
    assert {"glmvit_cupy.checkpoint.bind", "glmvit_cupy.preprocessing.image", "glmvit_cupy.scheduling.batching",
            "glmvit_cupy.cli.main", "glmvit_cupy.serving.app", "glmvit_cupy.engine.runner"} <= set(GRAPH)
    assert "glmvit_cupy.engine.model" in GRAPH["glmvit_cupy.engine.replicas"]


@pytest.mark.parametrize("host", HOST)
def test_host_half_never_imports_the_engine(host):
    """Only the Backend (its GPU path, imported inside its functions), the engine's own facades and the
    lazy package __init__ may reach the engine; the loader, preprocessing and the reference never."""
    direct = {t for t in GRAPH[host] if t.startswith("glmvit_cupy.engine")}
    if host == BACKEND:
        assert direct <= {"glmvit_cupy.engine.pools", "glmvit_cupy.engine.replicas", "glmvit_cupy.engine.uploads"}
    else:
        assert not direct, direct
        # Past the Backend, whose engine imports sit inside its GPU path.
        graph = {k: v for k, v in GRAPH.items() if k not in ("glmvit_cupy", BACKEND)}
        assert not reaches(host, "glmvit_cupy.engine.model", graph)


def test_loader_and_reference_share_nothing_with_the_engine():
    for m in ("glmvit_cupy.checkpoint.bind", "glmvit_cupy.reference"):
        assert not any(t.startswith("glmvit_cupy.engine") for t in GRAPH[m])


def test_host_half_imports_without_cupy():
    """Every host module imports in a process where CuPy cannot be imported (the serve and ray extras'
    modules only where those packages are installed: they are imported when used)."""
    code = ("import sys, importlib, importlib.util\n"
            "sys.modules['cupy'] = None\n"  # `import cupy` raises ImportError
            f"mods = {HOST!r}\n"
            "optional = {'glmvit_cupy.ray': 'ray', 'glmvit_cupy.serving.app': 'starlette',\n"
            "            'glmvit_cupy.serving.main': 'uvicorn', 'glmvit_cupy.serving.metrics': 'prometheus_client'}\n"
            "for m in mods:\n"
            "    need = optional.get(m)\n"
            "    if need and importlib.util.find_spec(need) is None:\n"
            "        continue\n"
            "    importlib.import_module(m)\n"
            "import glmvit_cupy\n"
            "assert glmvit_cupy.GlmVit is not None\n"  # a stand-in that raises GpuUnavailable when built
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_the_package_and_the_commands_import_without_ml_dtypes():
    """ml_dtypes takes ~0.5 s to import: `import glmvit_cupy`, the commands' modules and the client leave it to
    the first bf16 they read."""
    code = ("import sys, glmvit_cupy, glmvit_cupy.cli.main, glmvit_cupy.client, glmvit_cupy.output\n"
            "print('ml_dtypes' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr[-3000:])


def test_every_public_name_imports_from_the_package():
    for name in glmvit_cupy.__all__:
        assert getattr(glmvit_cupy, name) is not None, name
    # The documented modules are attributes of the package, without importing them first (ray: where the
    # extra is installed).
    for mod in glmvit_cupy._MODULES:
        if mod == "ray" and importlib.util.find_spec("ray") is None:
            continue
        assert getattr(glmvit_cupy, mod) is importlib.import_module(f"glmvit_cupy.{mod}")
    assert callable(glmvit_cupy.reference.encode_pixels) and glmvit_cupy.client.Client


def test_the_package_lists_its_public_names_not_its_own_imports():
    """dir(glmvit_cupy) listed os, annotations (the __future__ import) and TYPE_CHECKING beside the API: it lists
    the public names, the documented modules and the dunders; every name it lists is there."""
    listed = set(dir(glmvit_cupy))
    assert not {"os", "annotations", "TYPE_CHECKING", "_ENGINE", "_HOST", "_MODULES"} & listed, sorted(listed)
    assert set(glmvit_cupy.__all__) | set(glmvit_cupy._MODULES) | {"__version__", "__all__"} <= listed
    for name in listed - {"ray"}:  # ray: the extra may be missing
        getattr(glmvit_cupy, name)
    assert not hasattr(glmvit_cupy, "os")


def test_the_documented_subpackages_are_attributes_of_the_package():
    """docs/API.md names bind_tower's result glmvit_cupy.checkpoint.TowerBinding: `import glmvit_cupy` alone made
    checkpoint and config attributes, until the host names were imported on first use."""
    code = ("import glmvit_cupy\n"
            "print(glmvit_cupy.checkpoint.TowerBinding.__name__, glmvit_cupy.config.VisionGeometry.__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["TowerBinding", "VisionGeometry"], r.stderr[-3000:]


def test_preprocess_is_one_thing():
    """`glmvit_cupy.preprocess` is the function; its module lives under another name, so importing it
    never replaces the function on the package."""
    import glmvit_cupy.preprocessing.image as image

    assert callable(glmvit_cupy.preprocess) and glmvit_cupy.preprocess is image.preprocess
    assert not is_module("glmvit_cupy.preprocess")


def test_errors_importable_without_cupy():
    from glmvit_cupy import AbsentTower, CheckpointError, GpuOutOfMemory, ImageError, KernelError, NoVisionConfig

    assert issubclass(NoVisionConfig, CheckpointError) and issubclass(ImageError, ValueError)
    assert issubclass(GpuOutOfMemory, MemoryError) and issubclass(KernelError, RuntimeError)
    assert AbsentTower.__module__ == "glmvit_cupy.errors"
    for p in PKG.rglob("*.py"):  # defined once, in errors.py
        if p.name != "errors.py":
            assert "Error(" not in "".join(ln for ln in p.read_text().splitlines(True) if ln.startswith("class ")), p


def test_engine_facades_spell_out_their_keywords():
    """help(GlmVit) and help(Replicas) show every argument: no **kw on their constructors or
    from_checkpoint (read from the source: the engine needs CuPy to import)."""
    for name, cls in (("model.py", "GlmVit"), ("replicas.py", "Replicas")):
        tree = ast.parse((PKG / "engine" / name).read_text())
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
        for m in ("__init__", "from_checkpoint"):
            assert methods[m].args.kwarg is None, f"{cls}.{m} takes **{methods[m].args.kwarg.arg}"
            assert methods[m].args.kwonlyargs, f"{cls}.{m}"
