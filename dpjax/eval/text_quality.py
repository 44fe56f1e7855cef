"""Quality of synthetic queries against the original ones (paper section 6.2).

* BLEU, one-to-one: each synthetic query is generated from one training
  document, so it is scored against that document's original query (the
  first one in the qrels when a document has several). sacrebleu's corpus
  BLEU with its defaults (13a tokenizer, exponential smoothing, mixed case),
  on sacrebleu's 0-100 scale; the paper's Table 6 (e.g. 0.2939) reads as
  that / 100.
* MAUVE (Pillutla et al., 2021) between the original and the synthetic
  queries, `dpjax.eval.mauve` on features from a dpjax encoder.
  The features used here: T5 encoder states mean-pooled over the non-pad
  tokens (`t5_mean_encoder`), taken from the public pretrained T5 the
  generator started from (not from a DP-finetuned model, so the feature
  space does not change with ε). Any `encoding.TextEncoder` can stand in.
* n-gram memorisation: the paper gives no definition. Here: the fraction of
  the generated word n-grams (lower-cased, split on whitespace; every
  occurrence counts) that occur anywhere in the training queries, the
  private texts the generator was finetuned on. Computed from one set of
  training n-grams per n; a text with fewer than n words has no n-gram.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import sacrebleu

from dpjax.data.readers import msmarco
from dpjax.eval import encoding, mauve
from dpjax.models import t5


def bleu_one_to_one(synthetic: Sequence[str], original: Sequence[str]) -> dict:
  """`{"bleu": 0..100, "signature": sacrebleu's signature}`: corpus BLEU of
  `synthetic[i]` against `original[i]` alone, for every i."""
  if len(synthetic) != len(original) or not len(synthetic):
    raise ValueError(f"need as many synthetic as original texts (> 0); got "
                     f"{len(synthetic)} and {len(original)}")
  bleu = sacrebleu.BLEU()
  score = bleu.corpus_score(list(synthetic), [list(original)])
  return {"bleu": score.score, "signature": str(bleu.get_signature())}


def _ngrams(text: str, n: int) -> list[tuple[str, ...]]:
  words = text.lower().split()
  return list(zip(*(words[i:] for i in range(n))))


def ngram_memorization(generated: Sequence[str], training: Iterable[str],
                       ns: Sequence[int] = (3, 4, 5, 6, 7)) -> dict[int, float]:
  """`{n: fraction of the generated n-grams found in the training texts}`.

  NaN for an n where no generated text has n words. `training` is read once.
  """
  if not ns or min(ns) < 1:
    raise ValueError(f"n-gram orders must be positive, got {ns}")
  seen: dict[int, set[tuple[str, ...]]] = {n: set() for n in ns}
  for text in training:
    for n in ns:
      seen[n].update(_ngrams(text, n))
  rates = {}
  for n in ns:
    grams = [g for text in generated for g in _ngrams(text, n)]
    rates[n] = (sum(g in seen[n] for g in grams) / len(grams)) if grams else float("nan")
  return rates


def t5_mean_encoder(config: t5.T5Config):
  """`encode(params, tokens) -> float32 [b, d_model]`: a T5 model's encoder
  states averaged over the non-pad (id != 0) tokens; for
  `encoding.device_encode_fn`."""
  model = t5.T5Transformer(config)

  def encode(params, tokens: jax.Array) -> jax.Array:
    states = model.apply({"params": params}, tokens, method=t5.T5Transformer.encode)
    mask = (tokens != encoding.PAD_ID)[..., None].astype(jnp.float32)
    return (states.astype(jnp.float32) * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)

  return encode


def encoder_mauve(text_encoder: encoding.TextEncoder, original: Sequence[str],
                  synthetic: Sequence[str], **mauve_kwargs) -> float:
  """MAUVE of the synthetic texts against the original ones, on
  `text_encoder`'s embeddings (kwargs go to `compute_mauve`, e.g.
  `num_buckets`, `seed`)."""
  return mauve.mauve(text_encoder(list(original)), text_encoder(list(synthetic)),
                       **mauve_kwargs)


def one_to_one_pairs(synthetic_jsonl: str, data_dir: str = msmarco.DEFAULT_SAMPLE_DIR,
                     split: str = "train") -> tuple[list[str], list[str]]:
  """(synthetic, original) query lists from `dpjax.infer`'s `synthetic.jsonl`
  (`pid` and `query` per line) and the MSMARCO split the generator was
  trained on: the original of a passage is the first relevant query of its
  qrels. A passage without one is a `MalformedLineError` at its line."""
  qrels = os.path.join(data_dir, f"qrels.{split}.tsv")
  first_query: dict[int, int] = {}
  for qid, pid, rel, _ in msmarco.read_qrels(qrels):
    if rel > 0:
      first_query.setdefault(pid, qid)
  texts = dict(msmarco.read_tsv_pairs(os.path.join(data_dir, f"queries.{split}.tsv"),
                                      keep_ids=set(first_query.values())))
  synthetic, original = [], []
  with open(synthetic_jsonl, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        pid, query = int(record["pid"]), str(record["query"])
      except (ValueError, KeyError, TypeError) as e:
        raise msmarco.MalformedLineError(
            synthetic_jsonl, lineno, f"expected JSON with 'pid' and 'query' ({e})") from None
      if texts.get(first_query.get(pid)) is None:
        raise msmarco.MalformedLineError(
            synthetic_jsonl, lineno, f"passage {pid} has no original query in {qrels}")
      synthetic.append(query)
      original.append(texts[first_query[pid]])
  if not synthetic:
    raise ValueError(f"{synthetic_jsonl}: no synthetic queries")
  return synthetic, original


__all__ = ["bleu_one_to_one", "ngram_memorization", "t5_mean_encoder",
           "encoder_mauve", "one_to_one_pairs"]
