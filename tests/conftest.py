"""Test setup: CPU only, quiet TensorFlow, cheap code generation
(`tests/xla_env.py`), and one XLA compilation cache for the whole run:
tests build the same tiny models' steps many times, and the persistent
cache shares the compiled programs across processes. The pytest-xdist
workers and the commands the tests start as subprocesses (they inherit the
environment) share the one directory; a size limit turns on the cache's
file lock, so two processes never read an entry half written."""
import os
import shutil
import tempfile

from tests import xla_env

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Cheap code generation, inherited by the commands the tests start.
if "xla_llvm_disable_expensive_passes" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      f for f in (os.environ.get("XLA_FLAGS"), *xla_env.FAST_COMPILE) if f)

import pytest  # noqa: E402

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
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


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist, in the controller
  node.workerinput[_WORKER_KEY] = os.environ[_CACHE_ENV]


def pytest_unconfigure(config):
  if getattr(config, "dpjax_xla_cache", None):
    shutil.rmtree(config.dpjax_xla_cache, ignore_errors=True)
