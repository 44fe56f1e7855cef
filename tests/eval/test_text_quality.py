"""Synthetic-query quality: BLEU and memorisation by hand, MAUVE features
against a per-text encoder loop, one-to-one pairing against the raw files."""
import json
import math
import os

import jax
import numpy as np
import pytest

from dpjax.data.readers import msmarco
from dpjax.eval import encoding, text_quality
from dpjax.eval import mauve
from dpjax.models import t5
from tasks import msmarco as msmarco_tasks


def test_bleu_identical_disjoint_and_by_hand():
  texts = ["how tall is the copper tower", "who founded the harbour town"]
  assert text_quality.bleu_one_to_one(texts, texts)["bleu"] == pytest.approx(100.0)
  assert text_quality.bleu_one_to_one(["alpha beta gamma delta"],
                                      ["one two three four"])["bleu"] == 0.0
  # Clipped n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths: no penalty.
  result = text_quality.bleu_one_to_one(["the cat sat on the mat"],
                                        ["the cat sat on a mat"])
  hand = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** (1 / 4)
  assert result["bleu"] == pytest.approx(hand, abs=1e-6)
  assert "tok:13a" in result["signature"]
  # One-to-one: each text is scored against its own original only.
  assert text_quality.bleu_one_to_one(texts, texts[::-1])["bleu"] < 10
  with pytest.raises(ValueError, match="as many"):
    text_quality.bleu_one_to_one(texts, texts[:1])


def test_ngram_memorization_by_hand():
  training = ["the red fox jumps high", "A blue bird sings"]
  generated = ["The Red fox sleeps", "a blue bird sings loudly", "hi"]
  # Trigrams: "the red fox" yes, "red fox sleeps" no, "a blue bird" yes,
  # "blue bird sings" yes, "bird sings loudly" no -> 3 of 5.
  # Bigrams: the red, red fox, a blue, blue bird, bird sings yes; fox sleeps,
  # sings loudly no -> 5 of 7. No text has 6 words.
  rates = text_quality.ngram_memorization(generated, iter(training), ns=(2, 3, 6))
  assert rates[3] == pytest.approx(3 / 5)
  assert rates[2] == pytest.approx(5 / 7)
  assert math.isnan(rates[6])
  assert text_quality.ngram_memorization(training, training, ns=(1, 4)) == {1: 1.0, 4: 1.0}


@pytest.fixture(scope="module")
def tiny_t5():
  config = t5.T5Config(vocab_size=2000, d_model=16, d_kv=4, d_ff=32, num_heads=2,
                       num_encoder_layers=2, num_decoder_layers=1, dropout_rate=0.0)
  shapes, _ = t5.abstract_params(config, input_length=8, target_length=4)
  rng = np.random.default_rng(0)  # random weights without compiling an init
  params = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32), shapes)
  return config, params


def test_mauve_features_match_each_text_alone(tiny_t5):
  config, params = tiny_t5
  texts = ["how tall is the copper tower", "river", "who founded the harbour town"]
  tokenizer = encoding.Tokenizer(msmarco_tasks.DEFAULT_VOCABULARY_PATH)
  encode_fn = encoding.device_encode_fn(text_quality.t5_mean_encoder(config), params)
  text_encoder = encoding.TextEncoder(encode_fn, tokenizer, length=16, batch_size=2)
  features = text_encoder(texts)  # two batches, the second one padded

  model = t5.T5Transformer(config)
  encode_alone = jax.jit(lambda ids: model.apply({"params": params}, ids,
                                                 method=t5.T5Transformer.encode))
  alone = []
  for row in tokenizer(texts, 16):  # each text unpadded, its own forward pass
    alone.append(np.asarray(encode_alone(row[row != 0][None]))[0].mean(0))
  np.testing.assert_allclose(features, np.stack(alone), rtol=1e-4, atol=1e-5)

  kw = dict(num_buckets=2, kmeans_num_redo=1, seed=0)
  original, synthetic = texts * 6, [t.upper() for t in texts] * 6
  want = mauve.mauve(text_encoder(original), text_encoder(synthetic), **kw)
  assert text_quality.encoder_mauve(text_encoder, original, synthetic, **kw) == want


def test_one_to_one_pairs_with_the_training_queries(tmp_path):
  root = msmarco.DEFAULT_SAMPLE_DIR
  with open(os.path.join(root, "qrels.train.tsv")) as f:
    qrels = [line.split("\t") for line in f if line.strip()]
  with open(os.path.join(root, "queries.train.tsv"), encoding="utf-8") as f:
    queries = dict(line.rstrip("\n").split("\t") for line in f if line.strip())
  first = {}
  for qid, _, pid, _ in qrels:
    first.setdefault(pid, qid)
  pids = list(first)[:3] + [p for p in first if sum(r[2] == p for r in qrels) > 1][:1]
  path = tmp_path / "synthetic.jsonl"
  path.write_text("".join(json.dumps({"qid": i, "pid": int(p), "query": f"q{i}"}) + "\n"
                          for i, p in enumerate(pids)))
  synthetic, original = text_quality.one_to_one_pairs(str(path), root)
  assert synthetic == [f"q{i}" for i in range(len(pids))]
  assert original == [queries[first[p]].strip() for p in pids]

  path.write_text(json.dumps({"pid": int(pids[0]), "query": "a"}) + "\n"
                  '{"pid": 999999999, "query": "b"}\n')
  with pytest.raises(msmarco.MalformedLineError,
                     match=r"synthetic.jsonl:2: passage 999999999"):
    text_quality.one_to_one_pairs(str(path), root)
