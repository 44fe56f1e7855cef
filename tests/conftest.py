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
# Cheaper code generation: the suite's programs are tiny and each runs a few
# times, so compiling them dominates (docs/benchmarks.md, "Where the suite's
# time goes"). LLVM at level 0 without its expensive passes; XLA:CPU's
# classic elemental emitters instead of its MLIR fusion emitters, and each
# module compiled on one thread (two workers already fill both cores): on
# six of the heaviest files 266 s of CPU against 412 s with the LLVM flags
# alone, the same values. Targets compiled for GPUs use cuBLAS calls
# instead of Triton GEMM kernels (ptxas on fewer kernels). The tests check
# values, never speed; runs compared bit for bit compile under the same
# flags (commands the tests start inherit them: `tests/host_devices.py`).
_FAST_COMPILE = ("--xla_backend_optimization_level=0 "
                 "--xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false "
                 "--xla_cpu_parallel_codegen_split_count=1 "
                 "--xla_gpu_enable_triton_gemm=false")
if "xla_llvm_disable_expensive_passes" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      f for f in (os.environ.get("XLA_FLAGS"), _FAST_COMPILE) if f)

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
