"""dpjax's retrieval metrics against trec_eval (pytrec_eval, trec_eval's own
code) run on the files dpjax writes: tie order, the top-k cut, queries
without a relevant document, empty datasets."""
import json
import os
import re

import numpy as np
import pytest
import pytrec_eval

from dpjax.eval import encoding, ir_data, ir_metrics, retrieval, search
from tasks import msmarco

WORDS = ["copper", "harbour", "lantern", "quiet", "river", "glass", "north", "maple",
         "stone", "violet", "ember", "cedar"]


def _strcmp_descending(doc_id: str) -> bytes:
  """Sort key of trec_eval's tie order (strcmp of the UTF-8 bytes,
  descending), built from bytes rather than from Python's `str` order."""
  return bytes(255 - b for b in doc_id.encode("utf-8")) + b"\xff"


def _trec_sorted(scores: dict) -> list:
  return sorted(scores, key=lambda d: (-scores[d], _strcmp_descending(d)))


@pytest.fixture(scope="module")
def tokenizer():
  return encoding.Tokenizer(msmarco.DEFAULT_VOCABULARY_PATH)


# ---------------------------------------------------------------------------
# The tie order.
# ---------------------------------------------------------------------------


def test_trec_order_is_the_order_trec_eval_evaluates():
  ids = ["d9", "d10", "d1", "d100", "D2", "a", "ab", "abc", "b", "é", "z", "Z0"]
  scores = {**dict.fromkeys(ids, 1.0), "a": 2.0, "d1": 0.5}
  order = ir_metrics.trec_order(scores)
  assert order == _trec_sorted(scores)
  # 'é' is 0xC3 0xA9, after every ASCII byte; "d100" extends "d10".
  assert order == ["a", "é", "z", "d9", "d100", "d10", "b", "abc", "ab", "Z0",
                   "D2", "d1"]
  for rank, relevant in enumerate(order, start=1):  # where trec_eval ranks it
    result = pytrec_eval.RelevanceEvaluator(
        {"q": {relevant: 1}}, {"recip_rank"}).evaluate({"q": scores})
    assert result["q"]["recip_rank"] == pytest.approx(1 / rank)
  keys = search.trec_tie_keys(ids)
  assert sorted(ids, key=lambda d: keys[ids.index(d)]) == _trec_sorted(
      dict.fromkeys(ids, 0.0))


def test_write_trec_run_lists_each_query_in_trec_order(tmp_path):
  path = str(tmp_path / "run.trec")
  ir_metrics.write_trec_run(path, ["q1"], [["d1", "d3", "d2", "x"]],
                            np.array([[2.0, 1.0, 1.0, 1.0]], np.float32), "r")
  with open(path) as f:
    assert f.read() == ("q1 Q0 d1 1 2 r\nq1 Q0 x 2 1 r\nq1 Q0 d3 3 1 r\n"
                        "q1 Q0 d2 4 1 r\n")
  assert ir_metrics.read_trec_run(path) == {
      "q1": {"d1": 2.0, "x": 1.0, "d3": 1.0, "d2": 1.0}}
  with open(path, "a") as f:
    f.write("q1 Q0 d9 5 oops r\n")
  with pytest.raises(ir_data.MalformedLineError, match=r"run.trec:5: score 'oops'"):
    ir_metrics.read_trec_run(path)


# ---------------------------------------------------------------------------
# Search: the first k of trec_eval's order, ties at the cut included.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["device", "cpu"])
@pytest.mark.parametrize("spread", [1, 400_000])  # keys to 60, to 2.4e7 > 2**24
def test_search_keeps_the_first_k_of_the_tie_order(backend, spread):
  rng = np.random.default_rng(3)
  base = rng.integers(-1, 2, (12, 4)).astype(np.float32)
  corpus = base[rng.integers(0, 12, 61)]  # about 5 copies of each: ties
  ids = [f"p{i}" for i in rng.permutation(61) * 7]  # p0 .. p420, not in order
  queries = rng.integers(-1, 2, (6, 4)).astype(np.float32)
  keys = search.trec_tie_keys(ids).astype(np.int64) * spread + 3
  for k, shard_size in [(1, 8), (7, 8), (13, 5), (40, 16), (61, 61)]:
    shards = [corpus[i:i + shard_size] for i in range(0, 61, shard_size)]
    scores, indices = search.search(queries, shards, k=k, shard_size=shard_size,
                                    block_size=4, backend=backend, tie_keys=keys)
    for q, row_scores, row in zip(queries, scores, indices):
      everything = dict(zip(ids, (corpus @ q).tolist()))
      want = _trec_sorted(everything)[:k]
      assert [ids[i] for i in row] == want, (k, shard_size)
      np.testing.assert_array_equal(row_scores, [everything[d] for d in want])


# ---------------------------------------------------------------------------
# The job on a corpus with duplicated passages.
# ---------------------------------------------------------------------------


def _duplicated_beir(root, with_unjudged_query=True):
  """12 topics, each passage 2-5 times under different ids (bit-identical
  embeddings, so tied scores), one copy judged relevant; 16 other passages.
  Corpus order is random, so corpus position and doc id disagree on ties."""
  rng = np.random.default_rng(0)
  docs, qrels, queries = [], [], []
  for t, word in enumerate(WORDS):
    text = f"{word} {WORDS[(t + 1) % 12]} {WORDS[(t + 3) % 12]}"
    copies = [f"d{len(docs) + c:03d}" for c in range(2 + t % 4)]
    docs += [(c, text) for c in copies]
    queries.append((f"q{t}", f"{word} {WORDS[(t + 1) % 12]}"))
    qrels.append((f"q{t}", copies[int(rng.integers(len(copies)))], 1))
  docs += [(f"d{len(docs) + i:03d}", " ".join(rng.choice(WORDS, 3))) for i in range(16)]
  if with_unjudged_query:  # judged, but nothing relevant: scores 0
    queries.append(("qz", "quiet river"))
    qrels.append(("qz", docs[0][0], 0))
  os.makedirs(os.path.join(root, "qrels"))
  with open(os.path.join(root, "corpus.jsonl"), "w") as f:
    for i in rng.permutation(len(docs)):
      f.write(json.dumps({"_id": docs[i][0], "text": docs[i][1]}) + "\n")
  with open(os.path.join(root, "queries.jsonl"), "w") as f:
    f.writelines(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries)
  with open(os.path.join(root, "qrels", "test.tsv"), "w") as f:
    f.write("query-id\tcorpus-id\tscore\n")
    f.writelines(f"{q}\t{d}\t{r}\n" for q, d, r in qrels)
  return root


def _integer_encoder():
  """Sums of small integer rows per token: every score exact."""
  table = np.random.default_rng(1).integers(-2, 3, (2000, 8)).astype(np.float32)
  return lambda tokens: (table[tokens] * (tokens != 0)[..., None]).sum(1)


def _read_columns(path, columns):
  with open(path) as f:
    return [[line.split()[c] for c in columns] for line in f if line.strip()]


def _trec_eval_c(qrels_path, run_path):
  """trec_eval -c -M 10 on the two files, from their text: pytrec_eval per
  query on the whole run, MRR@10 = recip_rank when the first relevant is in
  the top 10, the mean over every query of the qrels (absent ones 0)."""
  qrels, run = {}, {}
  for q, d, r in _read_columns(qrels_path, (0, 2, 3)):
    qrels.setdefault(q, {})[d] = int(r)
  for q, d, s in _read_columns(run_path, (0, 2, 4)):
    run.setdefault(q, {})[d] = float(s)
  values = pytrec_eval.RelevanceEvaluator(
      qrels, {"ndcg_cut.10", "recall.10", "recip_rank"}).evaluate(run)
  zero = {"ndcg_cut_10": 0.0, "recall_10": 0.0, "recip_rank": 0.0}
  per_query = {q: values.get(q, zero) for q in qrels}
  mean = lambda f: float(np.mean([f(v) for v in per_query.values()]))  # noqa: E731
  return {"ndcg@10": mean(lambda v: v["ndcg_cut_10"]),
          "recall@10": mean(lambda v: v["recall_10"]),
          "mrr@10": mean(lambda v: v["recip_rank"] if v["recip_rank"] >= 0.1 else 0.0),
          "num_queries": len(qrels)}, run


@pytest.mark.parametrize("backend", ["cpu", "device"])
def test_job_metrics_are_trec_eval_of_its_files(tmp_path, tokenizer, backend):
  dataset = ir_data.load_beir(_duplicated_beir(str(tmp_path / "beir")))
  encode = _integer_encoder()
  runs = {}
  for top_k in (10, 100):
    out = str(tmp_path / f"out{top_k}")
    runs[top_k] = retrieval.evaluate_retrieval(
        dataset, encode, tokenizer, out, fingerprint={"model": "int"},
        doc_length=16, query_length=16, batch_size=8, shard_size=16, top_k=top_k,
        backend=backend, log=lambda _: None)
    with open(os.path.join(out, "metrics.json")) as f:
      assert json.load(f) == runs[top_k]
    want, run = _trec_eval_c(os.path.join(out, "qrels.trec"),
                             os.path.join(out, "run.trec"))
    for name, value in want.items():
      assert runs[top_k][name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    assert runs[top_k]["num_queries_without_relevant"] == 1
    assert "trec_eval -c" in runs[top_k]["averaged_over"]
    assert set(run) == set(dataset.qrels)  # the 0-judged query is searched too
  assert runs[10]["num_queries"] == 13 and runs[100]["top_k"] == dataset.corpus.num_docs

  # The file's order is trec_eval's: score, then doc id descending; the
  # top-10 run is the first 10 lines of each query of the full one.
  full = _read_columns(os.path.join(tmp_path, "out100", "run.trec"), (0, 2, 3, 4))
  cut = _read_columns(os.path.join(tmp_path, "out10", "run.trec"), (0, 2, 3, 4))
  by_query = {}
  for q, d, rank, s in full:
    by_query.setdefault(q, []).append((d, float(s)))
    assert int(rank) == len(by_query[q])
  for q, rows in by_query.items():
    assert [d for d, _ in rows] == _trec_sorted(dict(rows))
  assert cut == [row for row in full if int(row[2]) <= 10]
  for name in ("ndcg@10", "recall@10", "mrr@10"):
    assert runs[10][name] == runs[100][name]

  # One query by hand: q7's relevant passage has 5 copies, tied.
  texts = dict(dataset.corpus)
  emb = encode(tokenizer(list(texts.values()), 16))
  q7 = encode(tokenizer([dataset.queries["q7"]], 16))[0]
  scores = dict(zip(texts, (emb @ q7).tolist()))
  [relevant] = [d for d, r in dataset.qrels["q7"].items() if r > 0]
  copies = [d for d in texts if texts[d] == texts[relevant]]
  assert len(copies) == 5 and len({scores[d] for d in copies}) == 1
  rank = (1 + sum(s > scores[relevant] for s in scores.values())
          + sum(d.encode() > relevant.encode() for d in copies))
  per_query = ir_metrics.per_query(ir_metrics.read_trec_run(
      os.path.join(tmp_path, "out100", "run.trec")), dataset.qrels)
  assert per_query["q7"]["mrr@10"] == (1 / rank if rank <= 10 else 0.0)
  assert per_query["qz"] == {"ndcg@10": 0.0, "recall@10": 0.0, "mrr@10": 0.0}

  # The case needs the tie order: corpus-position ties score otherwise.
  qids = list(dataset.queries)
  ids = list(texts)
  _, positions = search.search(encode(tokenizer([dataset.queries[q] for q in qids], 16)),
                               [emb], k=10, shard_size=len(emb), backend="cpu")
  by_position = {q: {ids[i]: 10.0 - r for r, i in enumerate(row)}
                 for q, row in zip(qids, positions)}
  assert ir_metrics.evaluate(by_position, dataset.qrels)["mrr@10"] != runs[10]["mrr@10"]


# ---------------------------------------------------------------------------
# Datasets that cannot be evaluated: one line, exit status 2, nothing written.
# ---------------------------------------------------------------------------


def _beir(root, corpus='{"_id": "d1", "text": "one"}\n',
          queries='{"_id": "q1", "text": "which"}\n',
          qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\n"):
  os.makedirs(os.path.join(root, "qrels"))
  for name, text in (("corpus.jsonl", corpus), ("queries.jsonl", queries),
                     (os.path.join("qrels", "test.tsv"), qrels)):
    with open(os.path.join(root, name), "w") as f:
      f.write(text)
  return ["--dataset=beir", f"--data_dir={root}"]


def _msmarco(root, collection="1\tone\n", queries="7\twhich\n", qrels="7\t0\t1\t1\n"):
  os.makedirs(root)
  for name, text in (("collection.tsv", collection), ("queries.dev.tsv", queries),
                     ("qrels.dev.tsv", qrels)):
    with open(os.path.join(root, name), "w") as f:
      f.write(text)
  return [f"--data_dir={root}"]


@pytest.mark.parametrize("make, files, message", [
    (_beir, {"corpus": ""}, r"corpus.jsonl: the corpus has no documents"),
    (_beir, {"queries": "\n"}, r"queries.jsonl: no queries"),
    (_beir, {"qrels": "query-id\tcorpus-id\tscore\n"}, r"test.tsv: no judgements"),
    (_beir, {"qrels": "query-id\tcorpus-id\tscore\nq1\td1\t0\n"},
     r"test.tsv: no judgement with relevance > 0"),
    (_beir, {"qrels": "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td1\t2\n"},
     r"test.tsv:3: \(q1, d1\) judged 2 here and 1 on line 2"),
    (_msmarco, {"collection": ""}, r"collection.tsv: the corpus has no documents"),
    (_msmarco, {"queries": ""}, r"queries.dev.tsv: none of the 1 queries"),
    (_msmarco, {"qrels": ""}, r"qrels.dev.tsv: no judgements"),
    (_msmarco, {"qrels": "7\t0\t1\t1\n7\t0\t1\t0\n"},
     r"qrels.dev.tsv:2: \(7, 1\) judged 0 here and 1 on line 1"),
])
def test_cli_refuses_an_empty_dataset(tmp_path, capsys, make, files, message):
  flags = make(str(tmp_path / "data"), **files)
  model_dir = tmp_path / "run"
  with pytest.raises(SystemExit) as e:
    retrieval.cli([f"--model_dir={model_dir}", *flags])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: "), err
  assert re.search(message, err), err
  assert not model_dir.exists()


def test_loaders_keep_queries_without_a_relevant_document(tmp_path):
  root = str(tmp_path / "beir")
  _beir(root, queries='{"_id": "q1", "text": "a"}\n{"_id": "q2", "text": "b"}\n',
        qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td1\t0\n")
  dataset = ir_data.load_beir(root)
  assert dataset.qrels == {"q1": {"d1": 1}, "q2": {"d1": 0}}
  assert dataset.queries == {"q1": "a", "q2": "b"}
  root = str(tmp_path / "msmarco")
  _msmarco(root, queries="7\ta\n8\tb\n", qrels="7\t0\t1\t1\n8\t0\t1\t0\n8\t0\t1\t0\n")
  dataset = ir_data.load_msmarco(root)
  assert dataset.qrels == {"7": {"1": 1}, "8": {"1": 0}}
  assert dataset.queries == {"7": "a", "8": "b"}
