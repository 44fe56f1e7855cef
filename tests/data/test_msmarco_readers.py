"""MSMARCO readers on small hand-written directories."""
import logging
import os

import pytest

from dpjax.data.readers import msmarco

COLLECTION = """\
0\tThe first passage is about apples.
1\tThe second passage is about pears.
2\tA distractor passage nobody asks about.
3\tThe fourth passage is about plums.
"""
QUERIES_TRAIN = """\
100\twhat about apples
101\twhat about pears
102\tand plums
103\tan unjudged query
"""
QRELS_TRAIN = """\
100\t0\t0\t1
101\t0\t1\t1
102\t0\t3\t1
102\t0\t0\t1
101\t0\t2\t0
"""
QUERIES_DEV = "200\tpears again\n"
QRELS_DEV = "200\t0\t1\t1\n"


def _write_dir(root, **overrides):
  files = {
      "collection.tsv": COLLECTION,
      "queries.train.tsv": QUERIES_TRAIN,
      "qrels.train.tsv": QRELS_TRAIN,
      "queries.dev.tsv": QUERIES_DEV,
      "qrels.dev.tsv": QRELS_DEV,
  }
  files.update({k.replace("_", ".") + ".tsv": v for k, v in overrides.items()})
  os.makedirs(root, exist_ok=True)
  for name, text in files.items():
    if text is not None:
      with open(os.path.join(root, name), "w", encoding="utf-8") as f:
        f.write(text)
  return str(root)


def test_join_train_and_dev(tmp_path):
  d = _write_dir(tmp_path)
  assert msmarco.load_query_passage_pairs(d, "train") == [
      (100, 0, "what about apples", "The first passage is about apples."),
      (101, 1, "what about pears", "The second passage is about pears."),
      (102, 3, "and plums", "The fourth passage is about plums."),
      (102, 0, "and plums", "The first passage is about apples."),
  ]  # qrels order; the relevance-0 row is left out.
  dev = msmarco.load_query_passage_pairs(d, "dev")
  assert dev == [(200, 1, "pears again", "The second passage is about pears.")]
  assert msmarco.load_query_passage_pairs(d, "validation") == dev
  assert msmarco.load_collection_ids(d, "train") == [0, 1, 3]
  assert msmarco.load_collection_ids(d, "dev") == [1]


def test_read_tsv_pairs_and_qrels(tmp_path):
  d = _write_dir(tmp_path)
  path = os.path.join(d, "collection.tsv")
  assert [pid for pid, _ in msmarco.read_tsv_pairs(path)] == [0, 1, 2, 3]
  assert list(msmarco.read_tsv_pairs(path, keep_ids={3})) == [
      (3, "The fourth passage is about plums.")]
  rows = list(msmarco.read_qrels(os.path.join(d, "qrels.train.tsv")))
  assert [(q, p, r) for q, p, r, _ in rows][-1] == (101, 2, 0)


def test_crlf_and_trailing_blank_line_are_accepted(tmp_path):
  d = _write_dir(tmp_path, queries_dev="200\tpears again\r\n\n",
                 qrels_dev="200\t0\t1\t1\r\n")
  assert msmarco.load_query_passage_pairs(d, "dev")[0][2] == "pears again"


@pytest.mark.parametrize("field,text,line,reason", [
    ("collection", "0\tok\n1 no tab here\n", 2, "columns"),
    ("collection", "0\tok\nx1\ttext\n", 2, "not an integer"),
    ("collection", "0\tok\n1\t  \n", 2, "empty text"),
    ("collection", "0\tok\n0\tagain\n", 2, "duplicate id"),
    ("queries_train", "100\twhat\n101\ta\tb\n", 2, "columns"),
    ("qrels_train", "100\t0\t0\t1\n101\t1\n", 2, "columns"),
    ("qrels_train", "100\t0\t0\t1\n101\t0\t1\n", 2, "columns"),
    ("qrels_train", "100\t0\t0\t1\n101\t0\tp1\t1\n", 2, "integers"),
    ("qrels_train", "100\t0\t0\t1\n101\t0\t1\t1\n100\t0\t0\t0\n", 3,
     "(100, 0) judged 0 here and 1 on line 1"),
])
def test_malformed_line_reports_file_and_line(tmp_path, field, text, line,
                                              reason):
  d = _write_dir(tmp_path, **{field: text})
  name = field.replace("_", ".") + ".tsv"
  with pytest.raises(msmarco.MalformedLineError) as e:
    msmarco.load_query_passage_pairs(d, "train")
  assert str(e.value).startswith(f"{os.path.join(d, name)}:{line}: ")
  assert reason in str(e.value)
  assert (e.value.lineno, os.path.basename(e.value.path)) == (line, name)


def test_invalid_utf8_is_malformed(tmp_path):
  d = _write_dir(tmp_path)
  with open(os.path.join(d, "queries.train.tsv"), "ab") as f:
    f.write(b"104\tbad \xff byte\n")
  with pytest.raises(msmarco.MalformedLineError, match=r"queries.train.tsv:5: "):
    msmarco.load_query_passage_pairs(d, "train")


def test_skip_mode_skips_and_counts(tmp_path, caplog):
  d = _write_dir(
      tmp_path,
      collection=COLLECTION + "oops\n7\t\n",
      qrels_train=QRELS_TRAIN + "bad line\n")
  with caplog.at_level(logging.WARNING, logger="tasks.msmarco"):
    pairs = msmarco.load_query_passage_pairs(d, "train", on_malformed="skip")
  assert [(q, p) for q, p, _, _ in pairs] == [(100, 0), (101, 1), (102, 3),
                                              (102, 0)]
  messages = [r.getMessage() for r in caplog.records]
  coll = os.path.join(d, "collection.tsv")
  assert any(f"Skipped 2 malformed lines in {coll}" in m and f"{coll}:5:" in m
             for m in messages), messages
  qrels = os.path.join(d, "qrels.train.tsv")
  assert any(f"Skipped 1 malformed lines in {qrels}" in m and f"{qrels}:6:" in m
             for m in messages), messages


def test_qrels_row_with_missing_query_or_passage(tmp_path, caplog):
  d = _write_dir(tmp_path, qrels_train=QRELS_TRAIN + "999\t0\t0\t1\n"
                 "100\t0\t42\t1\n")
  with pytest.raises(msmarco.MalformedLineError,
                     match=r"qrels.train.tsv:6: query 999 not found"):
    msmarco.load_query_passage_pairs(d, "train")
  with caplog.at_level(logging.WARNING, logger="tasks.msmarco"):
    pairs = msmarco.load_query_passage_pairs(d, "train", on_malformed="skip")
  assert len(pairs) == 4
  [message] = [r.getMessage() for r in caplog.records]
  assert "Skipped 2 malformed qrels rows" in message
  assert "qrels.train.tsv:6: query 999 not found" in message
  with pytest.raises(msmarco.MalformedLineError,
                     match=r"qrels.train.tsv:1: passage 42 not found"):
    msmarco.load_query_passage_pairs(
        _write_dir(tmp_path / "b", qrels_train="100\t0\t42\t1\n"), "train")


def test_missing_directory_or_file(tmp_path):
  missing = str(tmp_path / "nope")
  with pytest.raises(FileNotFoundError) as e:
    msmarco.load_query_passage_pairs(missing, "train")
  assert missing in str(e.value) and "collection.tsv" in str(e.value)
  assert "qrels.train.tsv" in str(e.value)
  d = _write_dir(tmp_path / "partial", queries_dev=None)
  with pytest.raises(FileNotFoundError, match="queries.dev.tsv") as e:
    msmarco.load_query_passage_pairs(d, "dev")
  assert d in str(e.value)
  assert msmarco.load_query_passage_pairs(d, "train")  # train is complete


def test_bad_arguments(tmp_path):
  d = _write_dir(tmp_path)
  with pytest.raises(ValueError, match="split"):
    msmarco.load_query_passage_pairs(d, "test")
  with pytest.raises(ValueError, match="on_malformed"):
    msmarco.load_query_passage_pairs(d, "train", on_malformed="ignore")


def test_repeated_qrels_rows(tmp_path):
  """A (qid, pid) judged twice alike is one judgement (as the BEIR reader
  has it); judged twice differently is malformed, the first row kept when
  skipping."""
  d = _write_dir(tmp_path, qrels_train=QRELS_TRAIN + "100\t0\t0\t1\n")
  path = os.path.join(d, "qrels.train.tsv")
  rows = list(msmarco.read_qrels(path))
  assert [(q, p, r, n) for q, p, r, n in rows if (q, p) == (100, 0)] == [
      (100, 0, 1, 1)]
  assert len(rows) == 5
  assert len(msmarco.load_query_passage_pairs(d, "train")) == 4

  conflict = _write_dir(tmp_path / "c", qrels_train=QRELS_TRAIN + "101\t0\t2\t1\n")
  path = os.path.join(conflict, "qrels.train.tsv")
  with pytest.raises(msmarco.MalformedLineError) as e:
    list(msmarco.read_qrels(path))
  assert str(e.value) == f"{path}:6: (101, 2) judged 1 here and 0 on line 5"
  skipped = list(msmarco.read_qrels(path, on_malformed="skip"))
  assert [r for q, p, r, _ in skipped if (q, p) == (101, 2)] == [0]
