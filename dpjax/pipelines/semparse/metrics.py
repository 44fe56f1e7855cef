"""Distribution metrics of synthetic utterances against human test utterances.

The metrics of "Privacy-Preserving Domain Adaptation of Semantic Parsers"
(section 4.2 and appendix B.4). There is no one-to-one pairing between
synthetic and human utterances, so each compares two sets:

* language metrics, on the texts: word-type overlap, and MAUVE
  (`dpjax.eval.mauve`) on feature vectors (`text_features`: a dpjax GPT-2's
  last hidden state per text);
* parse metrics, on the function types of the texts' Lispress programs:
  function-type overlap, the chi-square distance between the function-type
  distributions, and top-k function coverage.

Function types come in as one list per program (e.g.
`dpjax.data.text.lispress.function_calls`, one entry per call); the overlaps
only look at which types occur, the distributions count every entry.
"""
from __future__ import annotations

import collections
import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.models.gpt2 import GPT2, GPT2Config

FunctionTypes = Sequence[Sequence[str]]  # one list of function types per program


def _word_types(texts: Iterable[str]) -> set[str]:
  return {word for text in texts for word in text.split()}


def _overlap(generated: set[str], reference: set[str], what: str) -> float:
  if not reference:
    raise ValueError(f"The reference has no {what}.")
  return len(generated & reference) / len(reference)


def word_type_overlap(generated: Iterable[str], reference: Iterable[str]) -> float:
  """W. Overlap: the fraction of the reference's word types that also occur
  in the generated texts.

  Word types are the distinct words of all texts split on whitespace
  ("tokenized using spaces"), case and punctuation kept.
  """
  return _overlap(_word_types(generated), _word_types(reference), "words")


def function_type_overlap(generated: FunctionTypes, reference: FunctionTypes) -> float:
  """F. Overlap: the fraction of the function types in the reference's
  programs that also occur in the generated texts' programs."""
  return _overlap({f for p in generated for f in p}, {f for p in reference for f in p},
                  "function types")


def _counts(programs: FunctionTypes, name: str) -> collections.Counter:
  counts = collections.Counter(f for p in programs for f in p)
  if not counts:
    raise ValueError(f"The {name} programs have no function types.")
  return counts


def chi_square_distance(generated: FunctionTypes, reference: FunctionTypes) -> float:
  """Dist.: the chi-square distance between the two function-type
  distributions, `1/2 * sum_f (p_f - q_f)^2 / (p_f + q_f)`.

  `p` and `q` are the normalized counts of every function type over all
  programs of each side; the sum runs over the types of either side. The
  distance is symmetric, 0 for equal distributions and 1 for disjoint ones.
  """
  gen, ref = _counts(generated, "generated"), _counts(reference, "reference")
  types = sorted(gen.keys() | ref.keys())
  p = np.array([gen[f] for f in types], np.float64) / sum(gen.values())
  q = np.array([ref[f] for f in types], np.float64) / sum(ref.values())
  return float(0.5 * np.sum((p - q) ** 2 / (p + q)))


def _most_common(counts: collections.Counter, k: int) -> set[str]:
  # Ties broken by name, so the result does not depend on input order.
  return set(sorted(counts, key=lambda f: (-counts[f], f))[:k])


def top_k_function_coverage(generated: FunctionTypes, reference: FunctionTypes,
                            k: int) -> float:
  """Top-k coverage (Table 6): the fraction of the reference's k most common
  function types that are among the generated programs' k most common.

  Commonness counts every entry; ties are broken by type name. With fewer
  than k reference types, the fraction is of all of them.
  """
  if k < 1:
    raise ValueError(f"k must be positive, got {k}.")
  ref_top = _most_common(_counts(reference, "reference"), k)
  return len(ref_top & _most_common(_counts(generated, "generated"), k)) / len(ref_top)


@functools.partial(jax.jit, static_argnums=0)
def _last_hidden(config: GPT2Config, params, tokens: jax.Array, lengths: jax.Array):
  hidden = GPT2(config).apply({"params": params}, tokens, return_hidden=True)
  return jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]


def text_features(config: GPT2Config, params, tokens: np.ndarray, lengths: np.ndarray, *,
                  batch_size: int = 64) -> np.ndarray:
  """MAUVE features: one vector per text, `[n, d_model]` float32.

  As mauve-text featurizes with GPT-2 large: the model's last hidden state
  (after the final norm) at the text's last token. `tokens` `[n, L]` are
  right-padded, row i being `tokens[i, :lengths[i]]` exactly as given (no
  token is added). Runs in batches of `batch_size` rows, the last one
  padded, so it compiles once per (config, batch_size, L).
  """
  tokens = np.asarray(tokens, np.int32)
  lengths = np.asarray(lengths, np.int32)
  if tokens.ndim != 2 or not len(tokens) or lengths.shape != tokens.shape[:1]:
    raise ValueError(f"Expected tokens [n, L] and lengths [n], n > 0; got shapes "
                     f"{tokens.shape} and {lengths.shape}.")
  if not (lengths.min() >= 1 and lengths.max() <= tokens.shape[1]):
    raise ValueError(f"Lengths must be in [1, {tokens.shape[1]}]; got {lengths.min()} to "
                     f"{lengths.max()}.")
  n = len(tokens)
  pad = -n % batch_size
  tokens = np.pad(tokens, ((0, pad), (0, 0)))
  lengths = np.pad(lengths, (0, pad), constant_values=1)
  batches = [_last_hidden(config, params, tokens[i:i + batch_size], lengths[i:i + batch_size])
             for i in range(0, n + pad, batch_size)]
  return np.concatenate([np.asarray(b) for b in batches])[:n]
