"""The classifier policy's model: a Flax BERT that predicts the domain of a
window of words.

As in the paper (Sec. 5.1: a sequence classifier "fine-tuned to predict the
domain from (a sequence of) tokens"), the classes are the training domains
and the examples are word windows of the training split's utterances,
labelled with their conversation's domain (`training_windows`: the same
windows `redaction.ClassifierPolicy` scores). The model is
`dpjax.models.bert.BertClassifier` with mean pooling (no [CLS] token needed)
over the byte-level BPE tokens of a window, truncated to `max_tokens`.

Training (`train_classifier`) is `dpjax.pipelines.text_classifier`'s: plain AdamW,
one jitted step on fixed-shape batches.

Formal guarantees: none. The classifier is trained without DP on the
training split, and the redaction it drives depends on all of that split.
The paper's accounting (Pub+Redacted at ε = 0, only DP steps spending ε)
treats the policy as given, i.e. assumes it reveals nothing of the private
text; a ledger built on redacted data inherits that assumption.

A saved classifier is a directory: `config.json` (BERT config, labels,
window and token lengths), `params.msgpack` (flax msgpack of the params) and
the tokenizer's `vocab.json` + `merges.txt`, so `DomainClassifier.load` (and
`classifier_policy`, the redaction policy it drives) need nothing else. The
MultiDoGo tasks take that policy from the pipeline, as gin bindings::

    register_multidogo_tasks.classifier_policy = @classifier_policy
    classifier_policy.classifier_dir = 'runs/dogo_clf'
    classifier_policy.threshold = 0.9

    python -m dpjax.pipelines.dialog.classifier --output_dir runs/dogo_clf

trains one on the embedded MultiDoGo sample (or `--data_dir`), sized by
`--gin_file` (default `models/bert_tiny.gin`).

No TensorFlow: jax, flax, optax, numpy and `tokenizers`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any, Mapping, Sequence

import flax.serialization
import gin
import jax
import numpy as np
import tokenizers

from dpjax import fileio, gin_cli
from dpjax.pipelines import text_classifier
from dpjax.data.readers import multidogo
from dpjax.models import bert
from dpjax.data.text import redaction

PyTree = Any
_FILES = ("config.json", "params.msgpack", "vocab.json", "merges.txt")


def training_windows(texts_by_domain: Mapping[str, Sequence[str]], *,
                     window_words: int = 16, stride: int = 8
                     ) -> tuple[list[str], np.ndarray]:
  """(window texts, int32 labels): the word windows of every text, labelled
  with the index of its domain in `texts_by_domain`'s order."""
  windows, labels = [], []
  for label, texts in enumerate(texts_by_domain.values()):
    for text in texts:
      words = text.split()
      for s in redaction.word_windows(len(words), window_words, stride):
        windows.append(" ".join(words[s:s + window_words]))
        labels.append(label)
  return windows, np.asarray(labels, np.int32)


def _tokenizer(vocab_path: str, merges_path: str) -> tokenizers.Tokenizer:
  return tokenizers.ByteLevelBPETokenizer(vocab_path, merges_path)


@dataclasses.dataclass(frozen=True, eq=False)
class DomainClassifier:
  """A trained window classifier: the text classifier, its domain labels, the
  tokenizer files and the window length it was trained on."""

  model: text_classifier.TextClassifier
  labels: tuple[str, ...]
  vocab_path: str
  merges_path: str
  window_words: int = 16

  def probabilities(self, windows: Sequence[str]) -> np.ndarray:
    """`[len(windows), len(labels)]` float32 class probabilities."""
    return self.model.probabilities(windows)

  def save(self, path: str) -> None:
    """Writes the directory `path` (see the module docstring); `config.json`
    is written last, so a directory that has it is complete."""
    os.makedirs(path, exist_ok=True)
    for src, name in ((self.vocab_path, "vocab.json"), (self.merges_path, "merges.txt")):
      if os.path.abspath(src) != os.path.abspath(os.path.join(path, name)):
        shutil.copyfile(src, os.path.join(path, name))
    with fileio.open_atomic(os.path.join(path, "params.msgpack"), "wb") as f:
      f.write(flax.serialization.msgpack_serialize(jax.device_get(self.model.params)))
    fileio.write_atomic(os.path.join(path, "config.json"), json.dumps({
        "bert_config": self.model.config.to_json(), "labels": list(self.labels),
        "window_words": self.window_words, "max_tokens": self.model.max_tokens,
    }, indent=2) + "\n")

  @classmethod
  def load(cls, path: str) -> "DomainClassifier":
    """Reads a directory written by `save`; checks the params' shapes."""
    missing = [f for f in _FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
      raise FileNotFoundError(f"not a saved domain classifier: {path!r} lacks "
                              f"{', '.join(missing)}")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
      meta = json.load(f)
    config = bert.BertConfig.from_json(meta["bert_config"])
    with open(os.path.join(path, "params.msgpack"), "rb") as f:
      params = flax.serialization.msgpack_restore(f.read())
    expected, _ = bert.abstract_params(config, max_length=meta["max_tokens"])
    shapes = jax.tree.map(lambda x: tuple(x.shape), params)
    if shapes != jax.tree.map(lambda x: tuple(x.shape), expected):
      raise ValueError(f"{path}/params.msgpack does not match the shapes of "
                       "its config.json")
    vocab, merges = (os.path.join(path, n) for n in ("vocab.json", "merges.txt"))
    model = text_classifier.TextClassifier(
        config, params, _tokenizer(vocab, merges), int(meta["max_tokens"]))
    return cls(model, tuple(meta["labels"]), vocab, merges,
               window_words=int(meta["window_words"]))


@gin.configurable
def classifier_policy(classifier_dir: str, *, threshold: float = 0.9,
                      stride: int | None = None) -> redaction.ClassifierPolicy:
  """The redaction policy of the classifier saved in `classifier_dir`: its
  windows are as long as those it was trained on, `stride` defaults to half
  of that, and a window is flagged above probability `threshold` (the
  paper's z)."""
  model = DomainClassifier.load(classifier_dir)
  return redaction.ClassifierPolicy(
      model.probabilities, model.labels, threshold=threshold,
      window_words=model.window_words,
      stride=stride or max(model.window_words // 2, 1))


def train_classifier(texts_by_domain: Mapping[str, Sequence[str]], *,
                     config: bert.BertConfig, vocab_path: str, merges_path: str,
                     window_words: int = 16, stride: int = 8,
                     max_tokens: int = 64, batch_size: int = 64,
                     epochs: float = 3.0, learning_rate: float = 1e-3,
                     weight_decay: float = 0.01, seed: int = 0
                     ) -> DomainClassifier:
  """Trains a domain classifier on the windows of `texts_by_domain`.

  Args:
    texts_by_domain: {domain: utterance texts} of the training split; the
      domains, in this order, are the classes.
    config: the BERT (e.g. `gin/models/bert_tiny.gin`); its `num_labels` must
      be the number of domains, `vocab_size` at least the tokenizer's and
      `max_position_embeddings` at least `max_tokens`.
    vocab_path, merges_path: byte-level BPE files of the tokenizer.
    window_words, stride: the training windows (`training_windows`).
    max_tokens, batch_size, epochs, learning_rate, weight_decay, seed: as in
      `text_classifier.train_classifier` (AdamW, learning rate decaying
      linearly to 0).
  """
  labels = tuple(texts_by_domain)
  if config.num_labels != len(labels):
    raise ValueError(f"BertConfig does not fit: num_labels {config.num_labels} "
                     f"!= {len(labels)} domains")
  windows, y = training_windows(texts_by_domain, window_words=window_words,
                                stride=stride)
  if len(set(y.tolist())) < 2:
    raise ValueError("need windows of at least two domains to train a classifier")
  model = text_classifier.train_classifier(
      windows, y, config=config, tokenizer=_tokenizer(vocab_path, merges_path),
      max_tokens=max_tokens, batch_size=batch_size, epochs=epochs,
      learning_rate=learning_rate, weight_decay=weight_decay, seed=seed)
  return DomainClassifier(model, labels, vocab_path, merges_path,
                          window_words=window_words)


def accuracy(model: DomainClassifier, texts_by_domain: Mapping[str, Sequence[str]],
             *, stride: int = 8) -> float:
  """Window accuracy on held-out texts (domains named as in `model.labels`)."""
  windows, y = training_windows(
      {d: texts_by_domain.get(d, ()) for d in model.labels},
      window_words=model.window_words, stride=stride)
  return float(np.mean(model.probabilities(windows).argmax(1) == y))


def main(argv: Sequence[str] | None = None) -> None:
  """Trains a classifier on MultiDoGo's training split and saves it."""
  def add_arguments(parser):
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--data_dir", default=None,
                        help="MultiDoGo unannotated/ directory (default: the sample)")
    parser.add_argument("--domains", default=",".join(multidogo.PAPER_DOMAINS))
    parser.add_argument("--vocab_path", default=multidogo.DEFAULT_BPE_VOCAB_PATH)
    parser.add_argument("--merges_path", default=multidogo.DEFAULT_BPE_MERGES_PATH)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--split_seed", type=int, default=0)

  args, gin_files, bindings = gin_cli.parse_args(
      list(sys.argv[1:] if argv is None else argv), main.__doc__, add_arguments)
  gin_cli.configure(gin_files or ["models/bert_tiny.gin"], bindings,
                    args.gin_search_paths)
  domains = tuple(args.domains.split(","))

  def texts(split):
    return multidogo.utterance_texts(multidogo.load_split(
        split, args.data_dir, domains, seed=args.split_seed))

  vocab_size = tokenizers.ByteLevelBPETokenizer(
      args.vocab_path, args.merges_path).get_vocab_size()
  config = bert.BertConfig(vocab_size=vocab_size, num_labels=len(domains),
                           max_position_embeddings=64, pooling="mean")
  start = time.perf_counter()
  model = train_classifier(texts("train"), config=config,
                           vocab_path=args.vocab_path,
                           merges_path=args.merges_path, epochs=args.epochs)
  model.save(args.output_dir)
  print(json.dumps({"output_dir": args.output_dir, "labels": model.labels,
                    "train_seconds": round(time.perf_counter() - start, 1),
                    "validation_window_accuracy": round(
                        accuracy(model, texts("validation")), 4)}))


if __name__ == "__main__":
  main()
