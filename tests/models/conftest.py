"""Shared tiny T5 models for the model tests.

Compilation dominates the runtime on CPU, so the tests share a few jitted
functions (cached per config and shape by jit) instead of running eagerly.
"""
import functools

import jax
import pytest

from dpjax.models import t5

VOCAB = 97


def tiny_config(**overrides) -> t5.T5Config:
  """T5 v1.0-style tiny model (the shapes of gin/models/t5_tiny.gin)."""
  fields = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.1)
  fields.update(overrides)
  return t5.T5Config(**fields)


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, enc, dec):
  return t5.T5Transformer(cfg).apply({"params": params}, enc, dec)


@pytest.fixture(scope="session")
def forward():
  """`forward(cfg, params, enc, dec) -> logits`, jitted."""
  return _forward


@pytest.fixture(scope="session")
def make_config():
  """The tiny-config factory, for tests that need variants."""
  return tiny_config


@pytest.fixture(scope="session")
def tiny():
  """(config, params, logical_axes) of the tiny v1.0 model."""
  cfg = tiny_config()
  params, axes = t5.init_params(cfg, jax.random.PRNGKey(0), input_length=8, target_length=8)
  return cfg, params, axes


@pytest.fixture(scope="session")
def tiny_v11():
  """(config, params, logical_axes) of the tiny T5.1.1-style model."""
  cfg = tiny_config(feed_forward="gated-gelu", tie_embeddings=False)
  params, axes = t5.init_params(cfg, jax.random.PRNGKey(1), input_length=8, target_length=8)
  return cfg, params, axes
