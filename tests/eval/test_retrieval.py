"""Retrieval evaluation: metrics by hand, search by brute force, the resumable
encoder by counting encoder calls, the loaders against the raw files."""
import csv
import json
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import errors
from dpjax.data.readers import beir, msmarco
from dpjax.eval import encoding, ir_data, ir_metrics, retrieval, search
from tasks import msmarco as msmarco_tasks

DIM = 16


@pytest.fixture(scope="module")
def tokenizer():
  return encoding.Tokenizer(msmarco_tasks.DEFAULT_VOCABULARY_PATH)


def test_tokenizer_decode_reads_generated_rows_as_seqio_does(tokenizer):
  import seqio
  vocab = seqio.SentencePieceVocabulary(msmarco_tasks.DEFAULT_VOCABULARY_PATH)
  texts = ["what is the capital of the region", "how tall is a giraffe"]
  rows = tokenizer(texts, 16)
  assert tokenizer.decode(rows) == texts
  # A pretrained T5's sentinel rows (ids past the pieces) and text after EOS.
  generated = np.array([[2099, 214, 131, 1, 55, 0], [7, 2000, 88, 9, 0, 0]])
  expected = [vocab.decode(row) for row in generated.tolist()]
  assert tokenizer.decode(generated) == expected
  assert "⁇" in expected[0] and "⁇" in expected[1]


def _table(vocab=2000):
  return np.random.default_rng(0).normal(size=(vocab, DIM)).astype(np.float32)


def _bag_of_tokens(table):
  """Stand-in encoder: normalised mean of a fixed random embedding per token."""
  def encode(tokens):
    mask = (tokens != 0)[..., None]
    mean = (table[tokens] * mask).sum(1) / np.maximum(mask.sum(1), 1)
    return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
  return encode


# ---------------------------------------------------------------------------
# Metrics against hand computation.
# ---------------------------------------------------------------------------


def _run(ranking):
  """A ranking (best first) as a run with strictly decreasing scores."""
  return {q: {d: float(len(docs) - i) for i, d in enumerate(docs)}
          for q, docs in ranking.items()}


def test_metrics_match_hand_computation():
  qrels = {
      "q1": {"d1": 2, "d2": 1, "d9": 0},   # graded
      "q2": {"z": 1},                       # found at rank 1, id sorts last
      "q3": {"x": 1, "y": 1},               # one at rank 4, one at rank 11
      "q4": {"w": 1},                       # not in the ranking at all: 0
      "q5": {"v": 0},                       # nothing relevant: 0 (trec_eval -c)
      "q6": {"b1": 1},                      # tied with "b2": ranked after it
  }
  ranking = {
      "q1": ["d9", "d1", "d5", "d2"],
      "q2": ["z", "a"],
      "q3": ["a", "b", "c", "x"] + [f"n{i}" for i in range(6)] + ["y"],
      "q5": ["v"],
      "unjudged": ["v"],                    # not in the qrels: ignored
  }
  run = {**_run(ranking), "q6": {"b1": 0.5, "b2": 0.5, "a": 0.75}}
  log2 = math.log2
  ndcg = {"q1": (2 / log2(3) + 1 / log2(5)) / (2 / log2(2) + 1 / log2(3)),
          "q2": 1.0,
          "q3": (1 / log2(5)) / (1 / log2(2) + 1 / log2(3)),
          "q4": 0.0, "q5": 0.0, "q6": (1 / log2(4))}
  recall = {"q1": 1.0, "q2": 1.0, "q3": 0.5, "q4": 0.0, "q5": 0.0, "q6": 1.0}
  mrr = {"q1": 1 / 2, "q2": 1.0, "q3": 1 / 4, "q4": 0.0, "q5": 0.0, "q6": 1 / 3}

  per_query = ir_metrics.per_query(run, qrels)
  assert sorted(per_query) == ["q1", "q2", "q3", "q4", "q5", "q6"]
  for q in per_query:
    assert per_query[q]["ndcg@10"] == pytest.approx(ndcg[q], abs=1e-4)
    assert per_query[q]["recall@10"] == pytest.approx(recall[q])
    assert per_query[q]["mrr@10"] == pytest.approx(mrr[q])
  means = ir_metrics.evaluate(run, qrels)
  assert means["num_queries"] == 6 and means["num_queries_without_relevant"] == 1
  assert means["ndcg@10"] == pytest.approx(np.mean(list(ndcg.values())), abs=1e-4)
  assert means["recall@10"] == pytest.approx(np.mean(list(recall.values())))
  assert means["mrr@10"] == pytest.approx(np.mean(list(mrr.values())))
  # MRR@10 ignores a first relevant document below rank 10.
  late = _run({"q": [f"n{i}" for i in range(10)] + ["r"]})
  assert ir_metrics.evaluate(late, {"q": {"r": 1}})["mrr@10"] == 0.0


# ---------------------------------------------------------------------------
# Search against brute force.
# ---------------------------------------------------------------------------


def _strcmp_descending(ids):
  """Sort key: doc ids in trec_eval's tie order (strcmp of the UTF-8 bytes,
  descending), from byte strings, independently of `str` order."""
  def key(i):
    return bytes(255 - b for b in ids[i].encode("utf-8")) + b"\xff"
  return key  # a longer id sorts first among ids it extends


def _brute_force(queries, corpus, k, tie=None):
  """Every score, sorted by (score desc, tie(index) asc; default the index),
  one query at a time."""
  out_s, out_i = [], []
  tie = tie or (lambda i: i)
  for q in queries:
    scores = corpus @ q
    order = sorted(range(len(corpus)), key=lambda i: (-scores[i], tie(i)))[:k]
    out_s.append(scores[order])
    out_i.append(order)
  return np.array(out_s), np.array(out_i)


@pytest.mark.parametrize("backend", ["device", "cpu"])
def test_search_with_ties_matches_brute_force(backend):
  rng = np.random.default_rng(1)
  # Halves of small integers: every product and sum is exact, ties abound.
  corpus = rng.integers(-1, 2, (53, 6)).astype(np.float32) / 2
  corpus[40] = corpus[3]  # duplicate documents tie exactly
  queries = rng.integers(-1, 2, (10, 6)).astype(np.float32) / 2
  shard_size, k = 8, 20  # 7 shards (the last holds 5), k > shard size
  shards = [corpus[i:i + shard_size] for i in range(0, len(corpus), shard_size)]
  scores, indices = search.search(queries, shards, k=k, shard_size=shard_size,
                                  block_size=4, backend=backend)
  want_scores, want_indices = _brute_force(queries, corpus, k)
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(scores, want_scores)
  with pytest.raises(ValueError, match="more than the 53"):
    search.search(queries, shards, k=54, shard_size=shard_size, backend=backend)


def test_search_backends_agree_on_random_embeddings():
  rng = np.random.default_rng(2)
  corpus = rng.normal(size=(37, 8)).astype(np.float32)
  queries = rng.normal(size=(5, 8)).astype(np.float32)
  shards = [corpus[:16], corpus[16:32], corpus[32:]]
  results = [search.search(queries, shards, k=37, shard_size=16, block_size=3,
                           backend=b) for b in ("device", "cpu")]
  want_scores, want_indices = _brute_force(queries, corpus, 37)
  for scores, indices in results:
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Tokenizer and the resumable corpus encoder.
# ---------------------------------------------------------------------------


def test_tokenizer_cuts_appends_eos_and_pads(tokenizer):
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=msmarco_tasks.DEFAULT_VOCABULARY_PATH)
  texts = ["when was culthaethport founded?", "a", ""]
  ids = [sp.encode(t) for t in texts]
  assert len(ids[0]) > 4
  tokens = tokenizer(texts, 5)
  assert tokens.dtype == np.int32 and tokens.shape == (3, 5)
  assert tokens[0].tolist() == ids[0][:4] + [1]
  assert tokens[1].tolist() == ids[1] + [1] + [0] * (4 - len(ids[1]))
  assert tokens[2].tolist() == [1, 0, 0, 0, 0]


class _Counting:
  """An encode_fn that counts its calls and can fail after `fail_after`."""

  def __init__(self, encode, fail_after=None):
    self.encode, self.fail_after, self.calls = encode, fail_after, 0

  def __call__(self, tokens):
    if self.fail_after is not None and self.calls >= self.fail_after:
      raise KeyboardInterrupt("stopped")
    self.calls += 1
    return self.encode(tokens)


def _corpus(n=23):
  words = ["copper", "harbour", "lantern", "quiet", "river", "glass", "north"]
  return [(f"doc{i}", " ".join(words[(i * j) % 7] for j in range(1, 3 + i % 5)))
          for i in range(n)]


def _encode_corpus(tmp_dir, encode_fn, tokenizer, docs, fingerprint=None):
  embed = encoding.TextEncoder(encode_fn, tokenizer, length=12, batch_size=2)
  return encoding.encode_corpus(iter(docs), len(docs), tmp_dir, embed, shard_size=5,
                                fingerprint=fingerprint or {"model": "bag"},
                                log=lambda _: None)


def test_resumable_encoder_skips_finished_shards(tmp_path, tokenizer):
  docs = _corpus()
  stand_in = _bag_of_tokens(_table())
  oneshot = _Counting(stand_in)
  reference = _encode_corpus(str(tmp_path / "oneshot"), oneshot, tokenizer, docs)
  assert oneshot.calls == 4 * 3 + 2  # 4 shards of 5 docs in batches of 2, then 3 docs
  want = np.concatenate([s.load() for s in reference])
  np.testing.assert_allclose(
      want, stand_in(tokenizer([t for _, t in docs], 12)), rtol=1e-6)

  out = str(tmp_path / "resumed")
  interrupted = _Counting(stand_in, fail_after=7)  # in the middle of shard 3
  with pytest.raises(KeyboardInterrupt):
    _encode_corpus(out, interrupted, tokenizer, docs)
  names = sorted(os.listdir(out))
  assert [n for n in names if n.endswith(".json") and n.startswith("shard")] == [
      "shard-00000-of-00005.json", "shard-00001-of-00005.json"]
  # Corrupt shard 0 in place (same size: only the checksum can tell).
  path0 = os.path.join(out, "shard-00000-of-00005.npy")
  data = bytearray(open(path0, "rb").read())
  data[-3] ^= 0xFF
  open(path0, "wb").write(bytes(data))
  kept = os.stat(os.path.join(out, "shard-00001-of-00005.npy"))

  rerun = _Counting(stand_in)
  shards = _encode_corpus(out, rerun, tokenizer, docs)
  assert rerun.calls == 3 + 3 + 3 + 2  # shards 0, 2, 3, 4; not shard 1
  again = os.stat(os.path.join(out, "shard-00001-of-00005.npy"))
  assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
  assert [i for s in shards for i in s.ids] == [d for d, _ in docs]
  np.testing.assert_array_equal(np.concatenate([s.load() for s in shards]), want)
  assert not [n for n in os.listdir(out) if n.endswith(".tmp")]

  finished = _Counting(stand_in)
  _encode_corpus(out, finished, tokenizer, docs)
  assert finished.calls == 0
  with pytest.raises(errors.UsageError, match="another output directory"):
    _encode_corpus(out, finished, tokenizer, docs, fingerprint={"model": "other"})
  with pytest.raises(ValueError, match="corpus ended after 22"):
    embed = encoding.TextEncoder(stand_in, tokenizer, length=12, batch_size=2)
    encoding.encode_corpus(iter(docs[:22]), 23, out, embed, shard_size=5,
                           fingerprint={"model": "bag"}, log=lambda _: None)


# ---------------------------------------------------------------------------
# Loaders.
# ---------------------------------------------------------------------------


def test_beir_loader_reads_the_sample():
  dataset = ir_data.load_beir(beir.SAMPLE_DIR)
  root = beir.SAMPLE_DIR
  with open(os.path.join(root, "corpus.jsonl"), encoding="utf-8") as f:
    raw = [json.loads(line) for line in f]
  with open(os.path.join(root, "queries.jsonl"), encoding="utf-8") as f:
    queries = {q["_id"]: q["text"] for q in map(json.loads, f)}
  with open(os.path.join(root, "qrels", "test.tsv"), encoding="utf-8") as f:
    rows = list(csv.reader(f, delimiter="\t"))[1:]
  assert dataset.corpus.num_docs == len(raw) == 56
  assert list(dataset.corpus) == [
      (d["_id"], f"{d['title']} {d['text']}" if d["title"] else d["text"]) for d in raw]
  qrels = {}
  for q, d, s in rows:
    qrels.setdefault(q, {})[d] = int(s)
  assert dataset.qrels == qrels
  assert dataset.queries == {q: queries[q] for q in qrels}
  assert sorted({s for docs in qrels.values() for s in docs.values()}) == [0, 1, 2]
  assert dataset.missing_judged_docs == 0


def _beir_dir(tmp_path, corpus=None, queries=None, qrels=None):
  root = tmp_path / "beir"
  (root / "qrels").mkdir(parents=True)
  (root / "corpus.jsonl").write_text(corpus or
      '{"_id": "d1", "title": "T", "text": "one"}\n{"_id": "d2", "text": "two"}\n')
  (root / "queries.jsonl").write_text(queries or '{"_id": "q1", "text": "which"}\n')
  (root / "qrels" / "test.tsv").write_text(
      qrels or "query-id\tcorpus-id\tscore\nq1\td2\t1\n")
  return str(root)


@pytest.mark.parametrize("field, content, where", [
    ("corpus", '{"_id": "d1", "text": "one"}\n\n{"_id": "d2", "text": }\n',
     r"corpus.jsonl:3: invalid JSON"),
    ("corpus", '{"_id": "d1", "text": "a"}\n{"_id": "d1", "text": "b"}\n',
     r"corpus.jsonl:2: duplicate id"),
    ("corpus", '{"_id": "d 1", "text": "a"}\n', r"corpus.jsonl:1: id 'd 1'"),
    ("corpus", '{"_id": "d1", "text": 3}\n', r"corpus.jsonl:1: field 'text' must be"),
    ("queries", '["q1", "which"]\n', r"queries.jsonl:1: expected a JSON object"),
    ("qrels", "q1\td2\t1\n", r"test.tsv:1: expected the header"),
    ("qrels", "query-id\tcorpus-id\tscore\nq1\td2\thigh\n",
     r"test.tsv:2: score must be an integer"),
    ("qrels", "query-id\tcorpus-id\tscore\nq1\td2\t1\nq1\td2\t2\n",
     r"test.tsv:3: \(q1, d2\) judged 2 here and 1 on line 2"),
    ("qrels", "query-id\tcorpus-id\tscore\nq1\td2\t1\nq7\td1\t1\n",
     r"test.tsv:3: query 'q7' not found"),
])
def test_beir_loader_names_file_and_line(tmp_path, field, content, where):
  root = _beir_dir(tmp_path, **{field: content})
  with pytest.raises(ir_data.MalformedLineError, match=where):
    ir_data.load_beir(root)


def test_beir_loader_keeps_judged_docs_missing_from_the_corpus(tmp_path):
  root = _beir_dir(tmp_path, qrels="query-id\tcorpus-id\tscore\nq1\td2\t1\nq1\tgone\t2\n")
  dataset = ir_data.load_beir(root)
  assert dataset.missing_judged_docs == 1
  assert dataset.qrels == {"q1": {"d2": 1, "gone": 2}}
  with pytest.raises(FileNotFoundError, match=r"qrels/dev.tsv"):
    ir_data.load_beir(root, split="dev")


def test_msmarco_loader_reads_the_sample():
  root = msmarco.DEFAULT_SAMPLE_DIR
  dataset = ir_data.load_msmarco()

  def rows(name):
    with open(os.path.join(root, name), encoding="utf-8") as f:
      return [line.rstrip("\n").split("\t") for line in f if line.strip()]

  qrels = {}
  for q, _, d, r in rows("qrels.dev.tsv"):
    qrels.setdefault(q, {})[d] = int(r)
  queries = dict(rows("queries.dev.tsv"))
  assert dataset.qrels == qrels and len(qrels) == 292
  assert dataset.queries == {q: queries[q].strip() for q in qrels}
  assert dataset.corpus.num_docs == len(rows("collection.tsv")) == 3260
  first = next(iter(dataset.corpus))
  assert first == tuple(rows("collection.tsv")[0])


# ---------------------------------------------------------------------------
# The job.
# ---------------------------------------------------------------------------


def test_job_on_beir_sample_matches_brute_force(tmp_path, tokenizer):
  table = jnp.asarray(_table())

  def encode(params, tokens):  # the stand-in, on the devices
    mask = (tokens != 0)[..., None]
    mean = (params[tokens] * mask).sum(1) / jnp.maximum(mask.sum(1), 1)
    return mean / jnp.linalg.norm(mean, axis=1, keepdims=True)

  encode_fn = encoding.device_encode_fn(encode, table)
  dataset = ir_data.load_beir(beir.SAMPLE_DIR)
  out = str(tmp_path / "out")
  results = retrieval.evaluate_retrieval(
      dataset, encode_fn, tokenizer, out, fingerprint={"model": "bag"},
      doc_length=64, query_length=16, batch_size=8, shard_size=16, top_k=20,
      backend="device", run_name="bag", log=lambda _: None)

  docs = list(dataset.corpus)
  plain = _bag_of_tokens(np.asarray(table))
  doc_emb = plain(tokenizer([t for _, t in docs], 64))
  qids = list(dataset.queries)
  query_emb = plain(tokenizer([dataset.queries[q] for q in qids], 16))
  _, order = _brute_force(query_emb, doc_emb, 20,
                          _strcmp_descending([d for d, _ in docs]))
  want = {q: [docs[i][0] for i in row] for q, row in zip(qids, order)}

  run = {}
  with open(os.path.join(out, "run.trec")) as f:
    for line in f:
      qid, q0, doc, rank, score, name = line.split()
      assert (q0, name) == ("Q0", "bag")
      assert int(rank) == len(run.setdefault(qid, [])) + 1
      run[qid].append(doc)
  assert run == want
  with open(os.path.join(out, "metrics.json")) as f:
    written = json.load(f)
  assert written == results
  expected = ir_metrics.evaluate(_run(want), dataset.qrels)
  for name in ("ndcg@10", "recall@10", "mrr@10", "num_queries"):
    assert results[name] == pytest.approx(expected[name])
  assert results["ndcg@10"] > 0.3  # names in queries and pages: far from chance


def test_cli_errors_before_loading_a_model(tmp_path):
  with pytest.raises(SystemExit):
    retrieval.main(["--model_dir=x", "--bogus_flag=1"])
  with pytest.raises(FileNotFoundError, match="data directory not found"):
    retrieval.main(["--model_dir=x", "--dataset=beir", f"--data_dir={tmp_path}/none"])
  with pytest.raises(FileNotFoundError, match="queries.test.tsv"):
    retrieval.main(["--model_dir=x", "--split=test"])
  root = _beir_dir(tmp_path, corpus='{"_id": "d1"}\n')
  with pytest.raises(ir_data.MalformedLineError, match="corpus.jsonl:1: missing field 'text'"):
    retrieval.main(["--model_dir=x", "--dataset=beir", f"--data_dir={root}"])
  with pytest.raises(errors.UsageError, match="top_k"):
    retrieval.main(["--model_dir=x", "--top_k=0"])


def test_cli_on_a_dual_encoder_run(tmp_path, monkeypatch):
  """`main` end to end with the dual encoder (a tiny random one standing in
  for a trained run directory)."""
  dual_encoder = pytest.importorskip("dpjax.models.dual_encoder")
  from dpjax.generation import inference
  from dpjax.models import t5
  config = dual_encoder.DualEncoderConfig(encoder=t5.T5Config(
      vocab_size=2000, d_model=16, d_kv=4, d_ff=32, num_heads=2,
      num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0))
  shapes, _ = dual_encoder.abstract_params(config)
  rng = np.random.default_rng(0)  # random weights without compiling an init
  params = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32), shapes)
  monkeypatch.setattr(inference, "load_trained", lambda _: (config, params, types.SimpleNamespace(step=3, tokenizer_files={})))
  model_dir = str(tmp_path / "run")
  results = retrieval.main([f"--model_dir={model_dir}", "--dataset=beir", "--top_k=10",
                            "--shard_size=20", "--batch_size=8", "--doc_length=64",
                            "--query_length=16", "--backend=device"])
  out = os.path.join(model_dir, "retrieval", "beir-beir_sample-test")
  with open(os.path.join(out, "metrics.json")) as f:
    assert json.load(f) == results
  assert results["encoder"]["step"] == 3 and results["num_queries"] == 30
  with open(results["run_file"]) as f:
    assert len(f.readlines()) == 30 * 10


def test_eval_modules_import_no_tensorflow_or_torch():
  code = ("import sys; from dpjax.eval import retrieval, text_quality; "
          "print(sorted({'tensorflow', 'seqio', 'torch'} & set(sys.modules)))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip() == "[]", out.stderr


def test_beir_sample_is_what_its_generator_writes(tmp_path):
  from tasks.beir_sample import generate
  generate.generate(str(tmp_path))
  for name in ("corpus.jsonl", "queries.jsonl", os.path.join("qrels", "test.tsv"),
               "README.md"):
    with open(tmp_path / name, "rb") as f, \
        open(os.path.join(beir.SAMPLE_DIR, name), "rb") as g:
      assert f.read() == g.read(), name
