"""The layers of dpjax point one way.

From the bottom: pure text logic (`dpjax.data.text`), the dataset readers
(`dpjax.data.readers`), the seqio tasks (`tasks`), then the pipelines. The DP
core (privacy, models, train step, decoding, partitioning) never imports
TensorFlow, and `dpjax.privacy` (which defines the layers ghost clipping
intercepts) never imports the models that use them.

The import graph is read from the source with `ast` (module-level imports,
and those inside functions); the TensorFlow check imports the modules in a
subprocess where TensorFlow cannot be imported.
"""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PIPELINES = ("dpjax.pipelines.dialog", "dpjax.pipelines.semparse", "dpjax.pipelines.seqpate", "dpjax.pipelines.textcls",
             "dpjax.pipelines.retrieval")
DP_CORE = ("dpjax.privacy", "dpjax.models", "dpjax.training.step",
           "dpjax.training.state", "dpjax.training.optimizer",
           "dpjax.generation.decoding", "dpjax.training.partitioning")
TENSORFLOW = ("tensorflow", "seqio", "tensorflow_datasets", "tensorflow_text")


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for top in ("dpjax", "tasks")
          for p in sorted((ROOT / top).rglob("*.py"))}


MODULES = _modules()


def _within(name: str, prefixes) -> bool:
  return any(name == p or name.startswith(p + ".") for p in prefixes)


def _targets(node, module: str, is_package: bool) -> list[str]:
  """The project modules an import statement names (a `from m import x`
  names `m.x` when that is a module, else `m`)."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    base = node.module or ""
    if node.level:
      package = module.split(".")
      package = package[:len(package) - node.level + (1 if is_package else 0)]
      base = ".".join(package + ([base] if base else []))
    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
             for a in node.names]
  return [n for n in names if n in MODULES]


def _imports() -> dict[str, dict[str, set[str]]]:
  """module -> {"module": targets imported at import time, "function":
  targets imported inside functions}."""
  graph = {}
  for module, path in MODULES.items():
    tree = ast.parse(path.read_text(), str(path))
    edges = {"module": set(), "function": set()}

    def visit(node, in_function):
      for child in ast.iter_child_nodes(node):
        inner = in_function or isinstance(
            child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, (ast.Import, ast.ImportFrom)):
          where = "function" if inner else "module"
          edges[where].update(_targets(child, module, path.name == "__init__.py"))
        visit(child, inner)

    visit(tree, False)
    graph[module] = edges
  return graph


GRAPH = _imports()


def _ancestors(name: str) -> list[str]:
  parts = name.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]


def _runtime_edges(module: str, kind: str) -> set[str]:
  """What importing the targets executes: each target and the packages
  above it (an `__init__` runs first), except the importer's own packages
  (already being imported)."""
  own = set(_ancestors(module))
  out = set()
  for t in GRAPH[module][kind]:
    out.update(a for a in [*_ancestors(t), t] if a not in own and a in MODULES)
  out.discard(module)
  return out


def _reachable(start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for t in _runtime_edges(todo.pop(), "module"):
      if t not in seen:
        seen.add(t)
        todo.append(t)
  return seen


def test_the_graph_sees_known_imports():
  # The parser finds what the source says (guards the tests below).
  assert "dpjax.privacy.layers" in GRAPH["dpjax.models.t5"]["module"]
  assert "dpjax.data.readers.msmarco" in GRAPH["tasks.msmarco"]["module"]
  assert "dpjax.data.readers.multidogo" in _reachable("dpjax.pipelines.dialog.classifier")


def test_no_module_level_import_cycle():
  cycles = sorted(m for m in MODULES if m in _reachable(m))
  assert not cycles, f"modules that import themselves back: {cycles}"


KNOWN_DODGES: set[tuple[str, str]] = set()


def test_no_function_level_import_dodges_a_cycle():
  # An import inside a function is for laziness, never to break a cycle.
  dodges = {(m, t) for m in MODULES for t in _runtime_edges(m, "function")
            if m in _reachable(t) or m == t}
  assert dodges - KNOWN_DODGES == set(), "function-level imports that close a cycle"


@pytest.mark.parametrize("layer, allowed", [
    ("dpjax.data.text", ("dpjax.data.text",)),
    ("dpjax.data.readers", ("dpjax.data.readers", "dpjax.data.text")),
])
def test_pure_layers_import_only_below_them(layer, allowed):
  bad = sorted((m, t) for m in MODULES if _within(m, [layer])
               for kind in ("module", "function") for t in GRAPH[m][kind]
               if not _within(t, allowed))
  assert not bad, bad


def test_the_data_layer_imports_no_pipeline():
  bad = sorted((m, t) for m in MODULES
               if _within(m, ["tasks", "dpjax.data.readers", "dpjax.data.text", "dpjax.data"])
               for kind in ("module", "function") for t in GRAPH[m][kind]
               if _within(t, PIPELINES))
  assert not bad, bad


ENGINE = ("dpjax.privacy", "dpjax.models", "dpjax.training",
          "dpjax.generation", "dpjax.data")


def test_the_engine_imports_no_pipeline():
  bad = sorted((m, t) for m in MODULES if _within(m, ENGINE)
               for kind in ("module", "function") for t in GRAPH[m][kind]
               if _within(t, ["dpjax.pipelines"]))
  assert not bad, bad


def test_the_engine_imports_no_task_definitions():
  # `tasks` imports dpjax's readers; the command lines register tasks.
  bad = sorted((m, t) for m in MODULES if _within(m, ENGINE)
               for kind in ("module", "function") for t in GRAPH[m][kind]
               if _within(t, ["tasks"]))
  assert not bad, bad


# Modules that run any mechanism through its interface
# (`dpjax.privacy.mechanisms.dpsgd.DPSGD`). `run_config` is the settings
# record: it holds what users set, mechanisms' settings among them.
MECHANISM_NEUTRAL = ("dpjax.training", "dpjax.generation", "dpjax.export",
                     "dpjax.verify", "dpjax.privacy.accounting",
                     "dpjax.privacy.ledger", "dpjax.privacy.noise",
                     "dpjax.privacy.optimizers")
SPECIFIC = ("bandmf", "adaptive", "user_level", "user_column", "cyclic")


def _code_names(module: str) -> set[str]:
  """Identifiers, attributes and imported names in `module`'s code (not its
  docstrings or comments), lower case."""
  names = set()
  for node in ast.walk(ast.parse(MODULES[module].read_text())):
    if isinstance(node, ast.Name):
      names.add(node.id)
    elif isinstance(node, ast.Attribute):
      names.add(node.attr)
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg)):
      names.add(getattr(node, "name", None) or node.arg)
    elif isinstance(node, ast.alias):
      names.update(filter(None, [*node.name.split("."), node.asname]))
    elif isinstance(node, ast.keyword) and node.arg:
      names.add(node.arg)
  return {n.lower() for n in names}


def test_the_engine_names_no_specific_mechanism():
  engine = [m for m in MODULES if _within(m, MECHANISM_NEUTRAL)
            and m != "dpjax.training.run_config"]
  assert "dpjax.training.plan" in engine and "dpjax.training.step" in engine
  bad = sorted((m, n) for m in engine for n in _code_names(m)
               if any(s in n for s in SPECIFIC))
  assert not bad, bad
  assert "adaptive_clipping" in _code_names(
      "dpjax.privacy.mechanisms.adaptive_clipping")  # the guard


def _top_level_imports(module: str) -> set[str]:
  """The top-level package of everything `module` imports, anywhere in it."""
  tops = set()
  for node in ast.walk(ast.parse(MODULES[module].read_text())):
    if isinstance(node, ast.Import):
      tops.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      tops.add((node.module or "").split(".")[0])
  return tops


def test_the_engine_reads_no_gin():
  # Configuration is parsed at the edge (`dpjax.configurables`, the command
  # lines); the engine takes typed records.
  engine = [m for m in MODULES
            if _within(m, ("dpjax.privacy", "dpjax.models", "dpjax.training",
                           "dpjax.generation"))]
  assert len(engine) > 40
  assert not [m for m in engine if "gin" in _top_level_imports(m)]
  assert "gin" in _top_level_imports("dpjax.configurables")  # the guard


def test_few_modules_at_the_top():
  # The top holds the command lines and the edge (gin, file writes); the
  # system is in its packages.
  top = sorted(p.name for p in (ROOT / "dpjax").glob("*.py"))
  assert len(top) <= 10, top


def test_sample_generators_stay_out_of_the_installed_package():
  # They write committed data: tools run from the repository, not library.
  import tomllib
  import setuptools
  find = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "tool"]["setuptools"]["packages"]["find"]
  installed = setuptools.find_packages(
      str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
  generators = sorted(p.parent.relative_to(ROOT).as_posix().replace("/", ".")
                      for p in (ROOT / "tasks").glob("*/generate.py"))
  assert generators and "tasks" in installed and "dpjax.training" in installed
  assert not set(generators) & set(installed), installed


def test_privacy_does_not_import_the_models():
  bad = sorted((m, t) for m in MODULES if _within(m, ["dpjax.privacy"])
               for kind in ("module", "function") for t in GRAPH[m][kind]
               if _within(t, ["dpjax.models"]))
  assert not bad, bad


def test_the_dp_core_imports_no_data_layer():
  bad = sorted((m, t) for m in MODULES if _within(m, DP_CORE)
               for kind in ("module", "function") for t in GRAPH[m][kind]
               if _within(t, ["tasks", "dpjax.data"]))
  assert not bad, bad


_BLOCK_TENSORFLOW = f"""
import importlib, sys

class Blocked:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {TENSORFLOW!r}:
      raise ImportError(f"TensorFlow is blocked here: {{name}}")

sys.meta_path.insert(0, Blocked())
for name in sys.argv[1:]:
  importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {TENSORFLOW!r})
assert not leaked, leaked
"""


def test_dp_core_readers_and_tasks_import_without_tensorflow():
  # `tasks` imports nothing heavy either: its registrations import seqio.
  # The bench runs on an accelerator host with no TensorFlow.
  names = sorted(m for m in MODULES
                 if _within(m, [*DP_CORE, "dpjax.data.readers", "dpjax.data.text",
                                "dpjax.bench", "dpjax.training.prefetch"])
                 and not m.endswith("__main__")) + ["tasks", "dpjax.data"]
  result = subprocess.run([sys.executable, "-c", _BLOCK_TENSORFLOW, *names],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]


def test_the_tensorflow_block_works():
  # The same subprocess fails where TensorFlow is imported (the data layer).
  result = subprocess.run(
      [sys.executable, "-c", _BLOCK_TENSORFLOW, "dpjax.data.arrays"], cwd=ROOT,
      capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode != 0 and "TensorFlow is blocked" in result.stderr


def test_dp_core_names_existing_modules():
  assert all(m in MODULES for m in DP_CORE)


def _imports_tensorflow_at_load(module: str) -> bool:
  """Whether importing `module` imports TensorFlow (or seqio, tfds):
  itself or anything it imports at module level."""
  for name in [module, *_reachable(module)]:
    tree = ast.parse(MODULES[name].read_text())
    for node in tree.body:
      if isinstance(node, ast.Import):
        tops = [a.name.split(".")[0] for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        tops = [(node.module or "").split(".")[0]]
      else:
        continue
      if set(tops) & set(TENSORFLOW):
        return True
  return False


def test_function_level_imports_of_the_project_are_lazy_for_tensorflow():
  # The only reason to import a dpjax module inside a function: it loads
  # TensorFlow, which the caller must not pay for (or need) at import.
  eager = sorted((m, t) for m in MODULES for t in GRAPH[m]["function"]
                 if not _imports_tensorflow_at_load(t))
  assert not eager, f"imports that could sit at the top: {eager}"
