"""Tests of the synthetic-utterance metrics (dpjax.pipelines.semparse.metrics).

The set metrics are checked against hand counts on small examples; text
features against the model applied to each text alone (MAUVE itself:
tests/eval/test_mauve.py).
"""
import functools

import jax
import numpy as np
import pytest

from dpjax.models import gpt2
from dpjax.pipelines.semparse import metrics

# Function types of two generated and two reference programs.
GEN = [["Yield", "Event", "Yield"], ["Weather"]]
REF = [["Yield", "Event", "Date"], ["Yield", "Person"]]


def test_word_type_overlap():
  generated = ["book a  table", "Book it\tnow"]
  reference = ["book a table for two", "cancel it", "book it"]
  # Reference types: book a table for two cancel it (7); of these the
  # generated texts have book a table it (4; "Book" is another type).
  assert metrics.word_type_overlap(generated, reference) == pytest.approx(4 / 7)
  assert metrics.word_type_overlap(reference, reference) == 1.0
  assert metrics.word_type_overlap(["nothing shared"], reference) == 0.0
  with pytest.raises(ValueError, match="no words"):
    metrics.word_type_overlap(generated, ["  "])


def test_function_type_overlap():
  # Reference types: Yield Event Date Person (4); generated has Yield Event.
  assert metrics.function_type_overlap(GEN, REF) == pytest.approx(2 / 4)
  # Generated types: Yield Event Weather (3); the reference has Yield Event.
  assert metrics.function_type_overlap(REF, GEN) == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="no function types"):
    metrics.function_type_overlap(GEN, [[]])


def test_chi_square_distance():
  # Generated counts Yield 2, Event 1, Weather 1 (of 4): p = .5 .25 .25 0 0;
  # reference counts Yield 2, Event 1, Date 1, Person 1 (of 5):
  # q = .4 .2 0 .2 .2 over (Yield, Event, Weather, Date, Person).
  # 1/2 (.1^2/.9 + .05^2/.45 + .25^2/.25 + .2^2/.2 + .2^2/.2)
  #   = 1/2 (1/90 + 1/180 + .25 + .2 + .2) = 1/2 * 2/3 = 1/3.
  assert metrics.chi_square_distance(GEN, REF) == pytest.approx(1 / 3)
  assert metrics.chi_square_distance(REF, GEN) == pytest.approx(1 / 3)
  # Same distribution from different counts; disjoint supports.
  assert metrics.chi_square_distance(REF, REF + REF[::-1]) == pytest.approx(0.0)
  assert metrics.chi_square_distance([["A", "B"]], [["C"]]) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="generated programs have no function types"):
    metrics.chi_square_distance([], REF)


def test_top_k_function_coverage():
  reference = [["A"] * 5 + ["B"] * 4, ["C"] * 3 + ["D"] * 2 + ["E"]]
  generated = [["F", "A", "C", "A"], ["C", "F", "B", "E", "C", "A"]]
  # Reference by count: A5 B4 C3 D2 E1; generated: A3 C3 F2 B1 E1.
  # k=3: {A, B, C} vs {A, C, F} -> 2/3.
  assert metrics.top_k_function_coverage(generated, reference, 3) == pytest.approx(2 / 3)
  # k=1: A vs A (A and C tie at 3; the name breaks the tie) -> 1.
  assert metrics.top_k_function_coverage(generated, reference, 1) == 1.0
  # k=2: {A, B} vs {A, C} -> 1/2.
  assert metrics.top_k_function_coverage(generated, reference, 2) == pytest.approx(1 / 2)
  # k beyond the 5 reference types: {A..E} vs {A, B, C, E, F} -> 4/5.
  assert metrics.top_k_function_coverage(generated, reference, 10) == pytest.approx(4 / 5)
  with pytest.raises(ValueError, match="k must be positive"):
    metrics.top_k_function_coverage(generated, reference, 0)




def test_text_features_match_each_text_alone():
  cfg = gpt2.GPT2Config(vocab_size=97, n_positions=16, d_model=32, num_layers=2, num_heads=4)
  params, _ = gpt2.init_params(cfg, jax.random.PRNGKey(0), max_length=8)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 97, (5, 9)).astype(np.int32)  # padding is random too
  lengths = np.array([3, 9, 1, 9, 3])
  # batch_size 2: three batches, the last one padded.
  features = metrics.text_features(cfg, params, tokens, lengths, batch_size=2)
  assert features.shape == (5, 32) and features.dtype == np.float32
  apply = jax.jit(functools.partial(gpt2.GPT2(cfg).apply, {"params": params}),
                  static_argnames="return_hidden")
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(features[i], apply(tokens[i:i + 1, :n], return_hidden=True)[0, -1],
                               atol=1e-5, rtol=1e-5)
  # The features are what the (tied) output layer turns into each text's
  # last logits (causal: the padding after a text does not matter).
  logits = apply(tokens)[np.arange(5), lengths - 1]
  np.testing.assert_allclose(features @ params["token_embedder"]["embedding"].T, logits,
                             atol=1e-4, rtol=1e-4)
  with pytest.raises(ValueError, match="Lengths"):
    metrics.text_features(cfg, params, tokens, np.array([3, 10, 1, 6, 9]))
