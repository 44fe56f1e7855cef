"""A BERT text classifier trained without DP, for the pipelines that need one:
the downstream utility evaluation of label-conditioned generation (an ICLR 2023
submission, OpenReview LUql3ZOFwFD, Sec. 6.2: train on synthetic labelled
texts, accuracy on the real held-out split) and the domain classifier behind
the dialog redaction policy (`dpjax.pipelines.dialog.classifier`).

The model is `dpjax.models.bert.BertClassifier` (the paper uses DistilBERT;
any `BertConfig`, e.g. `gin/models/bert_tiny.gin` on the embedded samples).
Texts are tokenized by a `tokenizers.Tokenizer` (the samples' byte-level BPE,
or a BERT WordPiece tokenizer, whose [CLS]/[SEP] its post-processor adds),
truncated to `max_tokens` and right-padded with id 0; the attention mask
comes from the lengths. Training is plain AdamW (not DP: the synthetic data
already carries the generator's guarantee) with a linearly decaying learning
rate (the paper's Table 5: batch 32, 5 epochs, lr 1e-4, decay), one jitted
step on fixed-shape batches; epochs are permutations, the last batch filled
from the next permutation.

Formal guarantees: none of its own. Trained on DP-synthetic texts, the
classifier is post-processing and inherits the generator's (ε, δ); trained
on real texts it has none.

No TensorFlow: jax, flax, optax, numpy and `tokenizers`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
import optax
import tokenizers

from dpjax.models import bert

PyTree = Any


def encode(tokenizer: tokenizers.Tokenizer, texts: Sequence[str], max_tokens: int
           ) -> dict[str, np.ndarray]:
  """int32 `tokens` and `attention_mask` `[n, max_tokens]` (truncated,
  right-padded with 0)."""
  ids = [e.ids[:max_tokens] for e in tokenizer.encode_batch(list(texts))]
  lengths = np.asarray([len(i) for i in ids])
  tokens = np.zeros((len(ids), max_tokens), np.int32)
  mask = np.arange(max_tokens)[None] < lengths[:, None]
  tokens[mask] = np.concatenate(ids) if ids else []
  return {"tokens": tokens, "attention_mask": mask.astype(np.int32)}


@functools.lru_cache(maxsize=None)
def _probabilities_fn(config: bert.BertConfig):
  predict = bert.make_predict(config)
  return jax.jit(lambda params, batch: jax.nn.softmax(predict(params, batch)))


@dataclasses.dataclass(frozen=True, eq=False)
class TextClassifier:
  """A trained classifier: BERT config, params and its tokenizer."""
  config: bert.BertConfig
  params: PyTree
  tokenizer: tokenizers.Tokenizer
  max_tokens: int
  batch_size: int = 256  # texts per jitted call (the last call is padded)

  def probabilities(self, texts: Sequence[str]) -> np.ndarray:
    """`[len(texts), num_labels]` float32 class probabilities."""
    fn, b = _probabilities_fn(self.config), self.batch_size
    padded = list(texts) + [""] * (-len(texts) % b)
    out = [np.asarray(fn(self.params, encode(self.tokenizer, padded[s:s + b], self.max_tokens)))
           for s in range(0, len(padded), b)]
    return (np.concatenate(out)[:len(texts)] if out
            else np.zeros((0, self.config.num_labels), np.float32))

  def accuracy(self, texts: Sequence[str], labels: Sequence[int]) -> float:
    """Fraction of `texts` whose most probable class is its label."""
    if len(texts) != len(labels) or not len(texts):
      raise ValueError(f"need as many labels as texts (> 0), got {len(labels)} and {len(texts)}")
    return float(np.mean(self.probabilities(texts).argmax(1) == np.asarray(labels)))


def _make_step(config: bert.BertConfig, optimizer: optax.GradientTransformation):
  model = bert.BertClassifier(config)

  def loss_fn(params, batch, rng):
    logits = model.apply({"params": params}, batch["tokens"],
                         attention_mask=batch["attention_mask"],
                         enable_dropout=config.dropout_rate > 0, rngs={"dropout": rng})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  @jax.jit
  def step(params, opt_state, batch, rng):
    grads = jax.grad(loss_fn)(params, batch, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def train_classifier(texts: Sequence[str], labels: Sequence[int], *,
                     config: bert.BertConfig, tokenizer: tokenizers.Tokenizer,
                     max_tokens: int = 64, batch_size: int = 32, epochs: float = 5.0,
                     learning_rate: float = 1e-4, weight_decay: float = 0.01,
                     seed: int = 0) -> TextClassifier:
  """Trains a classifier on labelled texts (labels 0..num_labels - 1).

  Args:
    texts, labels: the training set (e.g. a synthetic dataset).
    config: the BERT; `num_labels` classes, `vocab_size` at least the
      tokenizer's, `max_position_embeddings` at least `max_tokens`.
    tokenizer: any `tokenizers.Tokenizer`.
    max_tokens: tokens per text (longer texts are truncated).
    batch_size, epochs, learning_rate, weight_decay, seed: AdamW with the
      learning rate decaying linearly to 0; `epochs` may be fractional.
  """
  y = np.asarray(labels, np.int32)
  problems = []
  if len(texts) != len(y) or not len(y):
    problems.append(f"need as many labels as texts (> 0), got {len(y)} and {len(texts)}")
  elif y.min() < 0 or y.max() >= config.num_labels:
    problems.append(f"labels must be in 0..{config.num_labels - 1}")
  if config.vocab_size < tokenizer.get_vocab_size():
    problems.append(f"vocab_size {config.vocab_size} < the tokenizer's "
                    f"{tokenizer.get_vocab_size()}")
  if config.max_position_embeddings < max_tokens:
    problems.append(f"max_position_embeddings {config.max_position_embeddings} < "
                    f"max_tokens {max_tokens}")
  if problems:
    raise ValueError("cannot train the classifier: " + "; ".join(problems))
  data = {**encode(tokenizer, texts, max_tokens), "label": y}

  n = len(y)
  steps = max(math.ceil(epochs * n / batch_size), 1)
  rng = np.random.default_rng(seed)
  order = np.concatenate([rng.permutation(n) for _ in range(math.ceil(steps * batch_size / n))])
  optimizer = optax.adamw(optax.linear_schedule(learning_rate, 0.0, steps),
                          weight_decay=weight_decay)
  params, _ = bert.init_params(config, jax.random.key(seed), max_length=max_tokens)
  opt_state = optimizer.init(params)
  step = _make_step(config, optimizer)
  dropout_key = jax.random.key(seed + 1)
  for s in range(steps):
    idx = order[s * batch_size:(s + 1) * batch_size]
    params, opt_state = step(params, opt_state, {k: v[idx] for k, v in data.items()},
                             jax.random.fold_in(dropout_key, s))
  return TextClassifier(config, jax.device_get(params), tokenizer, max_tokens)
