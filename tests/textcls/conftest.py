"""A tiny GPT-2 + discriminator head shared by the textcls tests (compilation
dominates on CPU: one init and one jitted hidden-state forward per session)."""
import functools

import jax
import pytest

from dpjax.models import gpt2, gpt2_disc

LENGTH = 12  # rows: BOS label SEP + up to 9 text tokens (with EOS) + padding
VOCAB = 61
BOS, SEP, LABEL_IDS = 60, 57, (58, 59)


@pytest.fixture(scope="session")
def disc_model():
  """(config, params): 1 layer, d_model 16, no dropout."""
  lm = gpt2.GPT2Config(vocab_size=VOCAB, n_positions=32, d_model=16, num_layers=1,
                       num_heads=2, dropout_rate=0.0)
  config = gpt2_disc.GPT2DiscConfig(lm=lm, label_token_ids=LABEL_IDS, prefix_step=2,
                                    head_hidden=8)
  params, _ = gpt2_disc.init_params(config, jax.random.PRNGKey(0), max_length=LENGTH)
  return config, params


@functools.partial(jax.jit, static_argnums=0)
def _hidden(config, params, tokens):
  return gpt2.GPT2(config.lm).apply({"params": gpt2_disc.lm_params(params)}, tokens,
                                    return_hidden=True)


@pytest.fixture(scope="session")
def hidden_states():
  """`hidden_states(config, params, tokens [b, L]) -> [b, L, d]`, jitted."""
  return _hidden
