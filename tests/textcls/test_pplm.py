"""PPLM-steered sampling (dpjax.generation.pplm): step size 0 is `generate_causal` bit
for bit; a positive step raises the discriminator's p(a | x) of the
generations, with a head set by hand; the baselines' row layout and filter."""
import jax
import numpy as np

from dpjax.generation import decoding, pplm
from dpjax.models import gpt2_disc
from tests.textcls.conftest import BOS, LABEL_IDS, SEP

ROWS, NEW = 16, 8
LABELS = np.arange(ROWS) % 2
# Shared by both sampling tests (one compilation): right-padded prompts of
# three layouts, SEP banned, nucleus sampling.
KW = dict(max_new_tokens=NEW, top_p=0.9, eos_id=BOS, banned_ids=(SEP,))


def _prompts(lengths):
  prompts = np.full((ROWS, 4), BOS, np.int32)
  prompts[:, 1] = np.asarray(LABEL_IDS)[LABELS]
  prompts[:, 2] = SEP
  prompts[:, 3] = 7
  return prompts, np.asarray(lengths)


def test_step_size_zero_is_plain_sampling_bit_for_bit(disc_model):
  config, params = disc_model
  prompts, lengths = _prompts([3, 4, 1, 2] * 4)
  key = jax.random.PRNGKey(0)
  plain = decoding.generate_causal(config.lm, gpt2_disc.lm_params(params), prompts, lengths,
                                   rng=key, **KW)
  steered = pplm.pplm_generate_causal(config, params, prompts, lengths, LABELS, rng=key,
                                      step_size=0.0, num_iterations=3, kl_scale=0.1, **KW)
  np.testing.assert_array_equal(steered, plain)


def _hand_head(config, params, direction):
  """A head whose logit difference (class 1 - class 0) is
  4 * (gelu(direction . m + 3) - 3), about 4 * direction . m near 0."""
  hidden = np.zeros((config.lm.d_model, 8), np.float32)
  hidden[:, 0] = direction
  out = np.zeros((8, 2), np.float32)
  out[0] = [-2.0, 2.0]
  head = {"hidden": {"kernel": hidden, "bias": np.eye(8, dtype=np.float32)[0] * 3},
          "out": {"kernel": out, "bias": np.array([6.0, -6.0], np.float32)}}
  return {**params, "disc_head": head}


def test_positive_step_raises_the_discriminator_probability(disc_model):
  config, params = disc_model
  direction = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (config.lm.d_model,)))
  params = _hand_head(config, params, direction / np.linalg.norm(direction))
  prompts, lengths = _prompts([3] * ROWS)
  score_key = jax.random.PRNGKey(9)

  def p_target(step_size):
    out = pplm.pplm_generate_causal(config, params, prompts, lengths, LABELS,
                                    rng=jax.random.PRNGKey(2), step_size=step_size,
                                    num_iterations=3, gamma=1.0, **KW)
    rows = pplm.generated_rows(prompts, lengths, np.asarray(out), BOS)
    probs = pplm.discriminator_probs(config, params, rows, score_key)
    return probs[np.arange(ROWS), LABELS]

  plain, steered = p_target(0.0), p_target(40.0)
  # Both classes move towards their target, by a clear margin on average.
  assert all(steered[LABELS == c].mean() > plain[LABELS == c].mean() for c in (0, 1))
  assert steered.mean() > plain.mean() + 0.1, (plain, steered)


def test_generated_rows_and_classifier_filter():
  prompts = np.array([[9, 1, 2], [9, 2, 0]], np.int32)
  generated = np.array([[5, 6, 9, 9], [7, 8, 3, 4]], np.int32)
  rows = pplm.generated_rows(prompts, np.array([3, 2]), generated, eos_id=9)
  # Row 0 keeps its first EOS; row 1 (prompt of 2) has no EOS: all 4 tokens.
  np.testing.assert_array_equal(rows["tokens"], [[9, 1, 2, 5, 6, 9, 9],
                                                 [9, 2, 7, 8, 3, 4, 9]])
  np.testing.assert_array_equal(rows["attention_mask"], [[1, 1, 1, 1, 1, 1, 0],
                                                         [1, 1, 1, 1, 1, 1, 0]])
  probs = np.array([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]])
  np.testing.assert_array_equal(pplm.filter_by_classifier(probs, np.array([1, 1, 0])),
                                [True, False, False])
