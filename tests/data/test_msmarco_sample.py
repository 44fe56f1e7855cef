"""The embedded MSMARCO-format sample: determinism, layout and signal."""
import collections
import hashlib
import math
import os
import re

import pytest
import sentencepiece as spm

from dpjax.data.readers import msmarco

from tasks import msmarco as msmarco_tasks
from tasks.msmarco_sample import generate

SAMPLE_DIR = msmarco.DEFAULT_SAMPLE_DIR
TEXT_FILES = generate.FILES + ("README.md",)
SPM_MODEL = os.path.join(generate.SPM_SUBDIR, generate.SPM_MODEL_NAME + ".model")
SPM_VOCAB = os.path.join(generate.SPM_SUBDIR, generate.SPM_MODEL_NAME + ".vocab")


def _sha(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _read_tsv(path):
  with open(path, encoding="utf-8") as f:
    return [line.rstrip("\n").split("\t") for line in f]


@pytest.fixture(scope="module")
def fresh_dirs(tmp_path_factory):
  dirs = []
  for name in ("gen_a", "gen_b"):
    d = str(tmp_path_factory.mktemp(name))
    generate.generate(d)
    dirs.append(d)
  return dirs


def test_generation_is_deterministic(fresh_dirs):
  a, b = fresh_dirs
  for name in TEXT_FILES + (SPM_MODEL, SPM_VOCAB):
    assert _sha(os.path.join(a, name)) == _sha(os.path.join(b, name)), name


def test_committed_sample_equals_fresh_generation(fresh_dirs):
  fresh = fresh_dirs[0]
  for name in TEXT_FILES:
    assert _sha(os.path.join(SAMPLE_DIR, name)) == _sha(
        os.path.join(fresh, name)), f"{name}: rerun the generator"
  committed = spm.SentencePieceProcessor(
      model_file=os.path.join(SAMPLE_DIR, SPM_MODEL))
  new = spm.SentencePieceProcessor(model_file=os.path.join(fresh, SPM_MODEL))
  assert committed.get_piece_size() == new.get_piece_size()
  assert [committed.id_to_piece(i) for i in range(committed.get_piece_size())
          ] == [new.id_to_piece(i) for i in range(new.get_piece_size())]
  texts = [t for _, t in _read_tsv(os.path.join(SAMPLE_DIR, "collection.tsv"))[:50]]
  texts += [q for _, q in _read_tsv(os.path.join(SAMPLE_DIR, "queries.dev.tsv"))[:50]]
  assert committed.encode(texts) == new.encode(texts)


def test_sample_layout_and_sizes():
  total = sum(os.path.getsize(os.path.join(root, f))
              for root, _, files in os.walk(SAMPLE_DIR) for f in files)
  assert total < 3 * 2**20
  coll = _read_tsv(os.path.join(SAMPLE_DIR, "collection.tsv"))
  assert [int(pid) for pid, _ in coll] == list(range(len(coll)))
  for _, text in coll:
    assert generate.MIN_WORDS <= len(text.split()) <= generate.MAX_WORDS
  pids = {}
  for split, (lo, hi) in {"train": (2700, 3300), "dev": (250, 350)}.items():
    queries = _read_tsv(os.path.join(SAMPLE_DIR, f"queries.{split}.tsv"))
    qrels = _read_tsv(os.path.join(SAMPLE_DIR, f"qrels.{split}.tsv"))
    assert lo <= len(queries) <= hi
    assert all(len(row) == 2 and row[1] for row in queries)
    # TREC qrels exactly as MSMARCO publishes them: qid 0 pid 1.
    assert all(len(r) == 4 and r[1] == "0" and r[3] == "1" for r in qrels)
    assert sorted(q for q, _ in queries) == sorted(r[0] for r in qrels)
    pids[split] = {int(r[2]) for r in qrels}
  assert not pids["train"] & pids["dev"]  # dev entities are distinct
  distractors = len(coll) - len(pids["train"] | pids["dev"])
  assert distractors >= 100


def test_vocabulary_has_t5_special_ids():
  sp = spm.SentencePieceProcessor(
      model_file=os.path.join(SAMPLE_DIR, SPM_MODEL))
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  assert 1500 <= sp.get_piece_size() <= 2500
  assert generate.TASK_INPUT_PREFIX == msmarco_tasks.INPUT_PREFIX
  # No <unk> on the task's text, its prefix or printable ASCII.
  coll = _read_tsv(os.path.join(SAMPLE_DIR, "collection.tsv"))[:200]
  texts = [msmarco_tasks.INPUT_PREFIX + t for _, t in coll] + ["x_y: [a] ~ {b}?"]
  assert all(sp.unk_id() not in ids for ids in sp.encode(texts))


def _terms(text):
  return re.findall(r"[a-z0-9]+", text.lower())


def test_signal_queries_retrieve_their_own_passage():
  """BM25 over the collection ranks each train query's passage first."""
  coll = {int(pid): _terms(t) for pid, t in
          _read_tsv(os.path.join(SAMPLE_DIR, "collection.tsv"))}
  queries = dict(_read_tsv(os.path.join(SAMPLE_DIR, "queries.train.tsv")))
  qrels = [(r[0], int(r[2])) for r in
           _read_tsv(os.path.join(SAMPLE_DIR, "qrels.train.tsv"))]
  n = len(coll)
  avgdl = sum(len(t) for t in coll.values()) / n
  postings = collections.defaultdict(dict)  # term -> {pid: tf}
  for pid, terms in coll.items():
    for term, tf in collections.Counter(terms).items():
      postings[term][pid] = tf
  k1, b = 1.2, 0.75
  hits = 0
  for qid, pid in qrels:
    scores = collections.Counter()
    for term in set(_terms(queries[qid])):
      df = len(postings.get(term, ()))
      if not df:
        continue
      idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
      for p, tf in postings[term].items():
        scores[p] += idf * tf * (k1 + 1) / (
            tf + k1 * (1 - b + b * len(coll[p]) / avgdl))
    best = scores.most_common(2)
    # Strictly first: a tie with another passage counts as a miss.
    if best[0][0] == pid and (len(best) == 1 or best[1][1] < best[0][1]):
      hits += 1
  rate = hits / len(qrels)
  print(f"BM25 own-passage-first rate: {rate:.4f} ({hits}/{len(qrels)})")
  assert rate >= 0.95
