"""The GPT-2 + discriminator-head model (dpjax.models.gpt2_disc): prefix
weights by hand, the discriminator loss against an explicit per-prefix loop
(which also shows the label slot replaced), and the frozen-layer mask."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.models import gpt2, gpt2_disc
from tests.textcls.conftest import BOS, LABEL_IDS, LENGTH, SEP


def _example(label_id: int, text: list[int], key: int) -> dict:
  """A converted row: BOS label SEP text EOS, right-padded with BOS (= EOS)."""
  row = [BOS, label_id, SEP, *text, BOS]
  n = len(row)
  return {"tokens": np.array(row + [BOS] * (LENGTH - n), np.int32),
          "loss_weights": np.array([0, 0, 0] + [1] * (n - 3) + [0] * (LENGTH - n), np.float32),
          "attention_mask": np.array([1] * n + [0] * (LENGTH - n), np.int32),
          "dropout_rng": jax.random.PRNGKey(key)}


def _slot_token(config, key) -> int:
  """The documented draw: split(key, 3)[0], uniform over the vocabulary."""
  return int(jax.random.randint(jax.random.split(key, 3)[0], (), 0, config.lm.vocab_size))


def test_prefix_weights_rise_linearly(disc_model):
  config = disc_model[0]
  # Text lengths (with EOS) 5, 0, 1, 8 in rows of 11 = 3 + 8 positions.
  ends, weights = gpt2_disc.prefixes(config, jnp.array([5, 0, 1, 8]), 11)
  np.testing.assert_allclose(weights, [[1 / 6, 2 / 6, 3 / 6, 0], [0, 0, 0, 0],
                                       [1, 0, 0, 0], [1 / 10, 2 / 10, 3 / 10, 4 / 10]],
                             rtol=1e-6)
  # Prefixes of 2, 4, then the whole 5 tokens; the text starts at position 3.
  np.testing.assert_array_equal(ends[0, :3], [4, 6, 7])
  np.testing.assert_array_equal(ends[2, :1], [3])
  np.testing.assert_array_equal(ends[3], [4, 6, 8, 10])


def _loop_disc_loss(config, params, hidden_states, row, target: int) -> float:
  """Weighted cross entropy of the head on the mean hidden state of each
  prefix (2, 4 and all 5 text tokens), by hand in float64."""
  hidden = np.asarray(hidden_states(config, params, row[None])[0], np.float64)
  head = jax.tree.map(lambda x: np.asarray(x, np.float64), params["disc_head"])
  loss = 0.0
  for k, m in enumerate([2, 4, 5], start=1):
    h = hidden[:3 + m].mean(0) @ head["hidden"]["kernel"] + head["hidden"]["bias"]
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))  # gelu_new
    logits = h @ head["out"]["kernel"] + head["out"]["bias"]
    loss += k / 6 * (np.log(np.exp(logits).sum()) - logits[target])
  return loss


def test_disc_loss_is_a_per_prefix_loop_without_the_label(disc_model, hidden_states):
  config, params = disc_model
  losses = jax.jit(gpt2_disc.make_example_losses(config))
  ex = _example(LABEL_IDS[1], [5, 9, 14, 2], key=7)  # + EOS: prefixes of 2, 4, 5
  got = losses(params, ex)

  # The disc input has the documented random token in the label slot...
  slot = _slot_token(config, ex["dropout_rng"])
  assert slot not in LABEL_IDS
  disc_row = ex["tokens"].copy()
  disc_row[1] = slot
  np.testing.assert_allclose(got["disc"], _loop_disc_loss(config, params, hidden_states,
                                                          disc_row, target=1), rtol=2e-5)
  # ... and not the label (which would give another loss).
  assert abs(float(got["disc"]) - _loop_disc_loss(config, params, hidden_states, ex["tokens"],
                                                  target=1)) > 1e-4

  # The LM loss is GPT-2's own on the row with the label (prompt masked).
  reference = jax.jit(gpt2.make_example_loss(config.lm))(
      gpt2_disc.lm_params(params), {k: v for k, v in ex.items() if k != "dropout_rng"})
  np.testing.assert_allclose(got["lm"], reference, rtol=1e-6)

  # A slot without a label token has no disc loss; the host check names it.
  unlabelled = dict(ex, tokens=disc_row)
  assert float(losses(params, unlabelled)["disc"]) == 0.0
  with pytest.raises(ValueError, match=r"no label token at position 1 \(rows \[1\]"):
    gpt2_disc.check_label_slots(config, np.stack([ex["tokens"], disc_row]))


def test_trainable_mask_axes_and_config_json():
  lm = gpt2.GPT2Config(vocab_size=61, n_positions=32, d_model=16, num_layers=2, num_heads=2)
  frozen = gpt2_disc.GPT2DiscConfig(lm=lm, label_token_ids=LABEL_IDS, frozen_layers=(1,))
  params, axes = gpt2_disc.abstract_params(frozen, max_length=LENGTH)
  assert axes["disc_head"]["hidden"]["kernel"] == jax.sharding.PartitionSpec("embed", "mlp")
  assert params["disc_head"]["out"]["kernel"].shape == (16, 2)
  mask = gpt2_disc.trainable_mask(frozen, params)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  assert all(jax.tree.leaves(mask["layers_0"])) and not any(jax.tree.leaves(mask["layers_1"]))
  assert all(jax.tree.leaves(mask["disc_head"])) and all(jax.tree.leaves(mask["token_embedder"]))
  head_only = gpt2_disc.trainable_mask(
      gpt2_disc.GPT2DiscConfig(lm=lm, label_token_ids=LABEL_IDS, head_only=True), params)
  assert [k for k, v in head_only.items() if any(jax.tree.leaves(v))] == ["disc_head"]
  # The config survives a JSON round trip (checkpoint metadata).
  assert gpt2_disc.GPT2DiscConfig.from_json(json.loads(json.dumps(frozen.to_json()))) == frozen
  with pytest.raises(ValueError, match="frozen_layers"):
    gpt2_disc.GPT2DiscConfig(lm=lm, label_token_ids=LABEL_IDS, frozen_layers=(2,))
