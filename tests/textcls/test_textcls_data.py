"""SST-2 / AG News readers, the conditioning tokens and the seqio tasks
(tasks.textcls), on hand-written files and the embedded sample."""
import numpy as np
import pytest

from dpjax.data.readers import textcls

from tasks import textcls as textcls_tasks

try:  # while collecting, not mid-suite: pytest rewrites tfds's
  # testing/test_utils.py on import (its name matches test_*.py), and
  # CPython 3.11.7's AST conversion keeps its recursion depth in shared
  # state (CPython gh-106905, fixed in 3.11.8), so a data pipeline thread
  # still parsing (autograph) made that import fail with "AST constructor
  # recursion depth mismatch" once in a whole-suite run.
  import tensorflow_datasets.testing.mocking  # noqa: F401
except ImportError:  # the test below is skipped without tfds
  pass

SST2_TSV = ("sentence\tlabel\n"
            "a gorgeous , witty , seductive movie . \t1\n"
            "\n"
            "the plot is nothing but boilerplate clichés \"from start\" to finish \t0\n")
AG_NEWS_CSV = ('"3","Wall St. Bears Claw Back (Reuters)","Reuters - Short-sellers, '
               'the ""ultra-cynics"", are seeing green again."\n'
               '"1","Talks resume","Officials met in  the capital."\n'
               '"4","New chip","A faster\\chip."\n')


def _write(path, text: str):
  path.write_text(text, encoding="utf-8")
  return str(path)


def test_sst2_reader_maps_glue_tsv(tmp_path):
  path = _write(tmp_path / "train.tsv", SST2_TSV)
  got = list(textcls.read_sst2_tsv(path))
  assert got == [
      textcls.Example("a gorgeous , witty , seductive movie .", 1),
      textcls.Example('the plot is nothing but boilerplate clichés "from start" to finish', 0)]
  # Columns are found by name, in any order.
  swapped = _write(tmp_path / "swapped.tsv", "label\tsentence\n0\tdull .\n")
  assert list(textcls.read_sst2_tsv(swapped)) == [textcls.Example("dull .", 0)]


@pytest.mark.parametrize("line, reason", [
    ("too\tmany\tfields\n", "expected 2 tab-separated columns"),
    ("a sentence\t2\n", "label must be 0 or 1"),
    ("   \t1\n", "empty sentence"),
])
def test_sst2_malformed_line_names_file_and_line(tmp_path, line, reason):
  path = _write(tmp_path / "dev.tsv", SST2_TSV + line)
  with pytest.raises(textcls.MalformedLineError, match=f"^{path}:5: {reason}"):
    list(textcls.read_sst2_tsv(path))
  assert len(list(textcls.read_sst2_tsv(path, on_malformed="skip"))) == 2


def test_sst2_without_label_column_is_refused(tmp_path):
  # GLUE's test.tsv: `index \t sentence`, no labels.
  path = _write(tmp_path / "test.tsv", "index\tsentence\n0\tsomething .\n")
  with pytest.raises(textcls.MalformedLineError, match=f"^{path}:1: .*'label'"):
    list(textcls.read_sst2_tsv(path))


def test_ag_news_reader_maps_one_based_classes(tmp_path):
  path = _write(tmp_path / "train.csv", AG_NEWS_CSV)
  got = list(textcls.read_ag_news_csv(path))
  assert got == [
      textcls.Example('Wall St. Bears Claw Back (Reuters) Reuters - Short-sellers, the '
                      '"ultra-cynics", are seeing green again.', 2),
      textcls.Example("Talks resume Officials met in the capital.", 0),
      textcls.Example("New chip A faster\\chip.", 3)]
  assert [textcls.LABELS["ag_news"][e.label] for e in got] == ["business", "world", "sci/tech"]


@pytest.mark.parametrize("line, reason", [
    ('"5","Title","Body"\n', "class index must be 1..4"),
    ('"2","Only a title"\n', "expected 3 fields"),
    ('"2","Broken "quote","Body"\n', "malformed CSV"),
    ('"2"," ",""\n', "empty title and description"),
])
def test_ag_news_malformed_line_names_file_and_line(tmp_path, line, reason):
  path = _write(tmp_path / "test.csv", AG_NEWS_CSV + line)
  with pytest.raises(textcls.MalformedLineError, match=f"^{path}:4: {reason}"):
    list(textcls.read_ag_news_csv(path))
  assert len(list(textcls.read_ag_news_csv(path, on_malformed="skip"))) == 3


def test_tfds_source_maps_features(monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  # No TFDS data can be downloaded here: mock the two datasets' records.
  monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
  with tfds.testing.mock_data(num_examples=6):
    ag = textcls_tasks.load_examples("ag_news", "test", source="tfds")
    raw = list(tfds.as_numpy(tfds.builder("ag_news_subset").as_dataset(split="test")))
    sst = textcls_tasks.load_examples("sst2", "test", source="tfds")
  assert [e.label for e in ag] == [int(r["label"]) for r in raw]
  assert [e.text for e in ag] == [" ".join((r["title"] + b" " + r["description"])
                                           .decode().split()) for r in raw]
  assert len(sst) == 6 and {e.label for e in sst} <= {0, 1}


def test_tfds_source_without_prepared_data_is_a_clear_error(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  with pytest.raises(FileNotFoundError, match="not prepared"):
    textcls_tasks.load_examples("sst2", "train", source="tfds", tfds_data_dir=str(tmp_path))


@pytest.fixture(scope="module")
def vocabulary():
  return textcls_tasks.conditional_vocabulary()


def test_special_tokens_are_single_tokens_and_round_trip(vocabulary):
  base = vocabulary.vocab_size - len(textcls.EXTRA_TOKENS)
  for i, token in enumerate(textcls.EXTRA_TOKENS):
    assert vocabulary.encode(token) == [base + i]
  text = "a witty , seductive movie ."
  s = textcls.conditioning_string("sst2", 1, text)
  ids = vocabulary.encode(s)
  assert ids[:3] == [vocabulary.bos_id, vocabulary.token_id("<|positive|>"),
                     vocabulary.token_id(textcls.SEP_TOKEN)]
  assert ids[3:] == vocabulary.encode(text)
  # Decoding stops at EOS (= BOS), so the row after BOS round-trips.
  assert vocabulary.decode(ids[1:]) == s[len(textcls.BOS_TOKEN):]
  np.testing.assert_array_equal(
      textcls.prompt_tokens(vocabulary, "ag_news", [3, 0]),
      [[vocabulary.bos_id, base + 6, base], [vocabulary.bos_id, base + 3, base]])
  # Without the extra tokens a label would be split: refused.
  from dpjax.data import vocabularies
  plain = vocabularies.ByteLevelBPEVocabulary(textcls.DEFAULT_BPE_VOCAB_PATH,
                                              textcls.DEFAULT_BPE_MERGES_PATH)
  with pytest.raises(ValueError, match="not a single token"):
    textcls.label_token_ids(plain, "sst2")


def test_task_rows_put_the_label_at_its_slot(vocabulary):
  from dpjax.data import arrays

  textcls_tasks.register_textcls_tasks()
  examples = textcls.load_examples("sst2", "test")
  a = arrays.load_task_arrays("sst2_conditional_lm", "test",
                              textcls_tasks.TASK_FEATURE_LENGTHS["sst2"], converter="decoder_only")
  ids = np.asarray(textcls.label_token_ids(vocabulary, "sst2"))
  tokens = a["tokens"]
  assert tokens.shape == (len(examples), 67)
  np.testing.assert_array_equal(tokens[:, 0], vocabulary.bos_id)
  np.testing.assert_array_equal(tokens[:, textcls.LABEL_POSITION],
                                ids[[e.label for e in examples]])
  np.testing.assert_array_equal(tokens[:, 2], vocabulary.token_id(textcls.SEP_TOKEN))
  # The LM loss covers exactly the text and its EOS.
  np.testing.assert_array_equal(a["loss_weights"][:, :textcls.TEXT_START], 0)
  for row, weights, example in zip(tokens[:5], a["loss_weights"][:5], examples):
    text_ids = vocabulary.encode(example.text)
    n = len(text_ids)
    assert row[3:3 + n].tolist() == text_ids and row[3 + n] == vocabulary.eos_id
    assert weights.sum() == n + 1
