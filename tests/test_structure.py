"""The package's structure, checked from its source with ``ast`` (nothing is
imported): the import graph has no cycles, modules stay small, imports sit
at module top unless allowed below, and no module imports another's private
names.

Every ``import``/``from ... import`` anywhere in a module counts, function
bodies included, relative imports resolved. Importing ``a.b.c`` from outside
package ``a.b`` also runs ``a/b/__init__.py``, so that is an edge too (the
top package ``pallas_np`` excepted: every module is inside it).
"""
from __future__ import annotations

import ast
import pathlib
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "pallas_np"
MAX_LINES = 700

# Function-local imports of pallas_np modules, (importing module, imported
# module): why each is not at module top.
ALLOWED_LOCAL_IMPORTS = {
    ("pallas_np.explainer", "pallas_np.explainer.render"):
        "render imports matplotlib, an optional dependency, at its top",
    ("pallas_np.pytest_plugin", "pallas_np"):
        "the plugin loads in every pytest session: pallas_np is set up only "
        "when --pallas-numpy is given",
    ("pallas_np.pytest_plugin", "pallas_np.params"):
        "as above",
    ("pallas_np.mosaic_gpu", "pallas_np.mosaic_gpu.rules"):
        "the Mosaic GPU rules read JAX's plgpu modules (about an `import jax` to import): "
        "they register with the first Mosaic GPU kernel (_compat.families)",
    ("pallas_np.mosaic_gpu.entry", "pallas_np.mosaic_gpu.rules"):
        "as above: the Mosaic GPU executor, imported with the first Mosaic GPU kernel",
}


class Import(NamedTuple):
  importer: str
  lineno: int
  target: str       # the pallas_np module (or package) imported
  local: bool       # inside a function body
  private: str | None  # a private name imported from ``target``, if any


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  mods = {}
  for path in sorted((root / PACKAGE).rglob("*.py")):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    mods[".".join(parts)] = path
  return mods


def _is_package(path: pathlib.Path) -> bool:
  return path.name == "__init__.py"


def _resolve(name: str, mods) -> str | None:
  """The longest prefix of dotted ``name`` that is a module of ours."""
  while name and name not in mods:
    name = name.rpartition(".")[0]
  return name or None


def _is_private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def imports(mods=None) -> list[Import]:
  mods = mods if mods is not None else _modules()
  found = []
  for mod, path in mods.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    package = mod if _is_package(path) else mod.rpartition(".")[0]
    # Module aliases in this module: name -> module, for ``alias._private``.
    aliases: dict[str, str] = {}

    def add(target, node, local, private=None):
      found.append(Import(mod, node.lineno, target, local, private))

    def visit(node, local):
      for child in ast.iter_child_nodes(node):
        inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.Import):
          for a in child.names:
            if a.name == PACKAGE or a.name.startswith(PACKAGE + "."):
              target = _resolve(a.name, mods)
              add(target, child, inner)
              aliases[a.asname or a.name] = target if a.asname else PACKAGE
        elif isinstance(child, ast.ImportFrom):
          if child.level:
            base = package.split(".")
            if child.level > 1:
              base = base[:-(child.level - 1)]
            source = ".".join(base + ([child.module] if child.module else []))
          else:
            source = child.module or ""
          if source != PACKAGE and not source.startswith(PACKAGE + "."):
            continue
          for a in child.names:
            full = f"{source}.{a.name}"
            if full in mods:  # a module: ``from pallas_np import grid``
              add(full, child, inner)
              aliases[a.asname or a.name] = full
            else:
              add(_resolve(source, mods), child, inner,
                  a.name if _is_private(a.name) else None)
        visit(child, inner)

    visit(tree, False)
    # ``module._private`` through an alias of one of our modules.
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and _is_private(node.attr)
          and isinstance(node.value, ast.Name) and node.value.id in aliases
          and aliases[node.value.id] != mod
          and f"{aliases[node.value.id]}.{node.attr}" not in mods):
        found.append(Import(mod, node.lineno, aliases[node.value.id], False, node.attr))
  return found


def graph(mods=None) -> dict[str, set[str]]:
  """Module -> the modules importing it runs (parent packages included)."""
  mods = mods if mods is not None else _modules()
  edges: dict[str, set[str]] = {m: set() for m in mods}
  for imp in imports(mods):
    targets = [imp.target]
    # Importing a.b.c runs a/b/__init__.py first, unless we are inside a.b.
    parts = imp.target.split(".")
    for k in range(2, len(parts)):
      parent = ".".join(parts[:k])
      if parent in mods and not imp.importer.startswith(parent + ".") \
          and imp.importer != parent:
        targets.append(parent)
    for t in targets:
      if t != imp.importer:
        edges[imp.importer].add(t)
  return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  """One import cycle (``[a, b, ..., a]``), or None."""
  WHITE, GREY, BLACK = 0, 1, 2
  color = dict.fromkeys(edges, WHITE)
  stack: list[str] = []

  def dfs(v):
    color[v] = GREY
    stack.append(v)
    for w in sorted(edges.get(v, ())):
      if color.get(w, WHITE) == GREY:
        return stack[stack.index(w):] + [w]
      if color.get(w, WHITE) == WHITE:
        cycle = dfs(w)
        if cycle:
          return cycle
    stack.pop()
    color[v] = BLACK
    return None

  for v in sorted(edges):
    if color[v] == WHITE:
      cycle = dfs(v)
      if cycle:
        return cycle
  return None


# -- the checks -----------------------------------------------------------------
def check_no_cycles(mods=None):
  cycle = find_cycle(graph(mods))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def check_module_sizes(mods=None):
  mods = mods if mods is not None else _modules()
  big = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not big, f"modules over {MAX_LINES} lines (split them): {big}"


def check_local_imports(mods=None):
  bad = sorted(f"{i.importer}:{i.lineno} imports {i.target}" for i in imports(mods)
               if i.local and (i.importer, i.target) not in ALLOWED_LOCAL_IMPORTS)
  assert not bad, ("function-local imports of pallas_np modules (move them to the "
                   "module top, or add them to ALLOWED_LOCAL_IMPORTS with the reason): "
                   f"{bad}")


def check_private_imports(mods=None):
  bad = sorted(f"{i.importer}:{i.lineno} uses {i.target}.{i.private}" for i in imports(mods)
               if i.private is not None and i.target != i.importer)
  assert not bad, f"private names used from another module (make them public): {bad}"


def test_no_import_cycles():
  check_no_cycles()


def test_modules_are_small():
  check_module_sizes()


def test_no_unlisted_function_local_imports():
  check_local_imports()


def test_no_private_names_across_modules():
  check_private_imports()


def test_allowed_local_imports_are_still_needed():
  local = {(i.importer, i.target) for i in imports() if i.local}
  stale = sorted(set(ALLOWED_LOCAL_IMPORTS) - local)
  assert not stale, f"ALLOWED_LOCAL_IMPORTS lists imports that are gone: {stale}"


def test_the_graph_sees_the_package():
  """The checks look at something: the known layering is in the graph."""
  edges = graph()
  assert "pallas_np.memory" in edges["pallas_np.grid.kernel_plan"]
  assert "pallas_np.grid" in edges["pallas_np.api"]
  # A leaf: memory imports nothing of pallas_np but _compat (and the
  # environment-switch parser, itself a leaf).
  assert edges["pallas_np.memory"] <= {"pallas_np._compat", "pallas_np.env_switches"}
  assert not edges["pallas_np.env_switches"]
  assert any(i.local for i in imports())  # function bodies are walked


# -- each check fails when violated ------------------------------------------
def _fake_package(tmp_path, files: dict[str, str]):
  for rel, text in files.items():
    path = tmp_path / PACKAGE / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return _modules(tmp_path)


def _fails(check, mods, match):
  try:
    check(mods)
  except AssertionError as e:
    assert match in str(e), str(e)
    return
  raise AssertionError(f"{check.__name__} passed on a violating package")


def test_checks_catch_violations(tmp_path):
  mods = _fake_package(tmp_path, {
      "__init__.py": "",
      "a.py": "from pallas_np import b\n",
      "b.py": "def f():\n  from pallas_np.a import _hidden\n",
      # A cycle through a package's __init__: c -> sub.x runs sub/__init__ -> c.
      "c.py": "from pallas_np.sub import x\n",
      "sub/__init__.py": "from pallas_np import c\n",
      "sub/x.py": "from . import y\nfrom ..a import thing\n",
      "sub/y.py": "import pallas_np.b as bee\nbee._private()\n" + "\n" * MAX_LINES,
  })
  _fails(check_no_cycles, mods, "import cycle")
  cycle = find_cycle(graph(mods))
  assert set(cycle) in ({"pallas_np.a", "pallas_np.b"}, {"pallas_np.c", "pallas_np.sub"}), cycle
  _fails(check_module_sizes, mods, "pallas_np.sub.y")
  _fails(check_local_imports, mods, "pallas_np.b:2 imports pallas_np.a")
  _fails(check_private_imports, mods, "pallas_np.a._hidden")
  _fails(check_private_imports, mods, "pallas_np.b._private")
  # Relative imports are resolved.
  assert {"pallas_np.sub.y", "pallas_np.a"} <= graph(mods)["pallas_np.sub.x"]
  # Without the a <-> b cycle, the one through sub/__init__ is still found.
  (tmp_path / PACKAGE / "b.py").write_text("")
  assert set(find_cycle(graph(_modules(tmp_path)))) == {"pallas_np.c", "pallas_np.sub"}
