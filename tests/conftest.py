"""Test setup: CPU only, quiet TensorFlow, cheap code generation, and one
XLA compilation cache for the whole run: tests build the same tiny models'
steps many times, and the persistent cache shares the compiled programs
across processes. The pytest-xdist workers and the commands the tests start
as subprocesses (they inherit the environment) share the one directory; a
size limit turns on the cache's file lock, so two processes never read an
entry half written."""
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Cheaper LLVM code generation: the suite's programs are tiny and each runs
# a few times, so compiling them dominates. Measured on the whole suite
# (docs/benchmarks.md): 26 min 34 s with these flags, 28 min 41 s with the
# expensive passes off alone; level 0 slows the decoding-heavy pipeline
# files but speeds up the rest more. The tests check values, never speed;
# runs compared bit for bit compile under the same flags (commands the tests
# start inherit them; a test that sets XLA_FLAGS itself replaces them, and
# compares within a tolerance).
_FAST_COMPILE = ("--xla_backend_optimization_level=0 "
                 "--xla_llvm_disable_expensive_passes=true")
if "xla_llvm_disable_expensive_passes" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      f for f in (os.environ.get("XLA_FLAGS"), _FAST_COMPILE) if f)

import pytest  # noqa: E402

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"

# The slowest files, slowest first (worker-seconds, the sums of a whole run's
# `--junitxml` times). `--dist loadfile` hands a worker one whole file at a
# time, and by default the files with the most tests first; the heavy files
# hold few tests, so one of them started last kept a worker busy for minutes
# while the other had finished (e.g. 1,151 s against 1,029 s of tests). Longest
# first, the many short files fill in at the end.
_SLOWEST_FILES = (
    "tests/test_trainer.py",  # 260 s
    "tests/distributed/test_multihost.py",  # 164 s
    "tests/semparse/test_experiments.py",  # 153 s
    "tests/test_targets.py",  # 153 s
    "tests/privacy/test_bandmf.py",  # 128 s
    "tests/test_bench.py",  # 113 s
    "tests/test_partitioning.py",  # 75 s
    "tests/experiments/test_retrieval_experiment.py",  # 71 s
    "tests/textcls/test_experiment.py",  # 65 s
    "tests/test_dry_run.py",  # 65 s
    "tests/privacy/test_adaptive_clipping.py",  # 63 s
    "tests/test_outsider.py",  # 56 s
    "tests/privacy/test_ghost.py",  # 52 s
    "tests/models/test_remat.py",  # 51 s
    "tests/models/test_lora.py",  # 47 s
    "tests/dialog/test_membership.py",  # 44 s
    "tests/seqpate/test_experiment.py",  # 41 s
    "tests/privacy/test_user_level.py",  # 40 s
    "tests/test_padding.py",  # 38 s
)
_WORKER_KEY = "dpjax_xla_cache"


def pytest_configure(config):
  if hasattr(config, "workerinput"):  # an xdist worker: the controller's
    os.environ.setdefault(_CACHE_ENV, config.workerinput[_WORKER_KEY])
  elif _CACHE_ENV not in os.environ:  # the user's own cache wins
    config.dpjax_xla_cache = tempfile.mkdtemp(prefix="dpjax-xla-cache-")
    os.environ[_CACHE_ENV] = config.dpjax_xla_cache
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))
  import jax  # reads the environment if not imported before
  from jax.experimental.compilation_cache import compilation_cache
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_compilation_cache_max_size",
                    int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
  compilation_cache.reset_cache()  # in case something compiled already
  if hasattr(config.option, "loadscopereorder"):  # xdist: keep our order
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  """Slowest files first (`_SLOWEST_FILES`); the order within a file and of
  the other files is kept."""
  rank = {path: i for i, path in enumerate(_SLOWEST_FILES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0],
                                       len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist, in the controller
  node.workerinput[_WORKER_KEY] = os.environ[_CACHE_ENV]


def pytest_unconfigure(config):
  if getattr(config, "dpjax_xla_cache", None):
    shutil.rmtree(config.dpjax_xla_cache, ignore_errors=True)
