"""Test setup: CPU only, quiet TensorFlow, and one XLA compilation cache for
the session: many tests build the same tiny models' steps as new closures,
which the in-memory jit cache cannot share but the persistent one can."""
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402  (after the platform is chosen)
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _session_compilation_cache():
  if jax.config.jax_compilation_cache_dir:  # the user's own cache wins
    yield
    return
  with tempfile.TemporaryDirectory(prefix="dpjax-xla-cache-") as path:
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()  # in case something compiled already
    yield
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
