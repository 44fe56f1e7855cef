"""The seqio task and its numpy materialisation, checked against a direct
SentencePiece encoding of the files (an independent computation)."""
import ast
import os
import re

import gin
import numpy as np
import pytest
import sentencepiece as spm
import seqio

from dpjax.data import arrays
from dpjax.data.readers import msmarco
from dpjax.eval import retrieval as retrieval_eval
import tasks
from tasks import msmarco as msmarco_tasks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = msmarco.DEFAULT_SAMPLE_DIR
LENGTHS = {"inputs": 384, "targets": 128}
EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def sp():
  return spm.SentencePieceProcessor(model_file=msmarco_tasks.DEFAULT_VOCABULARY_PATH)


@pytest.fixture(scope="module")
def task():
  return msmarco_tasks.register_msmarco_query_generation(task_name="test_msmarco_qg")


def _expected(sp, text, length):
  ids = sp.encode(text)[:length - 1] + [EOS]
  return ids + [PAD] * (length - len(ids))


def test_training_and_retrieval_eval_use_the_papers_lengths():
  """The paper's 384 document and 128 query tokens: bound by the gin file
  every MS MARCO paper config includes, and the retrieval evaluation's
  defaults (both from the task's constant, so they cannot drift apart)."""
  text = open(os.path.join(REPO, "gin", "msmarco_query_generation.gin")).read()
  bound = ast.literal_eval(re.search(r"^TASK_FEATURE_LENGTHS = (\{.*\})$",
                                     text, re.M).group(1))
  args = retrieval_eval._parser().parse_args(["--model_dir=unused"])
  assert bound == LENGTHS
  assert {"inputs": args.doc_length, "targets": args.query_length} == LENGTHS


def test_task_examples(task, sp):
  assert isinstance(task, seqio.Task)
  assert seqio.get_mixture_or_task("test_msmarco_qg") is task
  pairs = msmarco.load_query_passage_pairs(SAMPLE, "dev")
  assert task.num_input_examples("validation") == len(pairs)
  assert task.num_input_examples("train") == len(
      msmarco.load_query_passage_pairs(SAMPLE, "train"))
  for feature in task.output_features.values():
    assert feature.add_eos and feature.required
    assert feature.vocabulary.eos_id == EOS and feature.vocabulary.pad_id == PAD
  ds = task.get_dataset(LENGTHS, split="validation", shuffle=False)
  examples = list(ds.as_numpy_iterator())
  assert len(examples) == len(pairs)
  prefix = sp.encode("generate_query:")
  for ex, (qid, pid, query, passage) in zip(examples, pairs):
    assert (int(ex["qid"]), int(ex["pid"])) == (qid, pid)
    assert ex["inputs_pretokenized"].decode() == "generate_query: " + passage
    assert ex["targets_pretokenized"].decode() == query
    assert list(ex["inputs"][:len(prefix)]) == prefix
    assert list(ex["inputs"]) == sp.encode("generate_query: " + passage) + [EOS]
    assert list(ex["targets"]) == sp.encode(query) + [EOS]


def test_lengths_are_respected(task):
  lengths = {"inputs": 24, "targets": 6}
  ds = task.get_dataset(lengths, split="validation", shuffle=False)
  n = 0
  for ex in ds.as_numpy_iterator():
    for k in lengths:
      assert 0 < len(ex[k]) <= lengths[k] and ex[k][-1] == EOS
    n += 1
  assert n == task.num_input_examples("validation")


def test_load_task_arrays(task, sp):
  pairs = msmarco.load_query_passage_pairs(SAMPLE, "dev")
  a = arrays.load_task_arrays("test_msmarco_qg", "validation", LENGTHS)
  assert sorted(a) == sorted(arrays.ENC_DEC_FEATURES)
  n = len(pairs)
  assert a["encoder_input_tokens"].shape == (n, 384)
  for k in ("decoder_input_tokens", "decoder_target_tokens",
            "decoder_loss_weights"):
    assert a[k].shape == (n, 128)
  for k in ("encoder_input_tokens", "decoder_input_tokens",
            "decoder_target_tokens"):
    assert a[k].dtype == np.int32
  assert a["decoder_loss_weights"].dtype == np.float32
  targets = np.array([_expected(sp, q, 128) for _, _, q, _ in pairs])
  inputs = np.array([_expected(sp, "generate_query: " + p, 384)
                     for _, _, _, p in pairs])
  np.testing.assert_array_equal(a["encoder_input_tokens"], inputs)
  np.testing.assert_array_equal(a["decoder_target_tokens"], targets)
  shifted = np.concatenate([np.zeros((n, 1), np.int32), targets[:, :-1]], 1)
  np.testing.assert_array_equal(a["decoder_input_tokens"], shifted)
  np.testing.assert_array_equal(a["decoder_loss_weights"],
                                (targets != PAD).astype(np.float32))


def test_load_task_arrays_train_and_packed(task):
  a = arrays.load_task_arrays("test_msmarco_qg", "train", LENGTHS)
  n = task.num_input_examples("train")
  assert a["encoder_input_tokens"].shape == (n, 384)
  packed = arrays.load_task_arrays("test_msmarco_qg", "train", LENGTHS,
                                   pack=True)
  assert len(packed["encoder_input_tokens"]) < n
  assert packed["encoder_segment_ids"].dtype == np.int32
  # Packing loses no target token.
  assert packed["decoder_loss_weights"].sum() == a["decoder_loss_weights"].sum()


def test_load_task_inputs(task, sp):
  tokens, info = arrays.load_task_inputs("test_msmarco_qg", "train", 384)
  pids = msmarco.load_collection_ids(SAMPLE, "train")
  assert [m["pid"] for m in info] == pids  # one per document, qrels order
  assert tokens.shape == (len(pids), 384) and tokens.dtype == np.int32
  passages = {p: text for _, p, _, text in
              msmarco.load_query_passage_pairs(SAMPLE, "train")}
  for row, m in zip(tokens[:100], info[:100]):
    assert list(row) == _expected(sp, "generate_query: " + passages[m["pid"]],
                                  384)
    assert m["inputs_pretokenized"] == "generate_query: " + passages[m["pid"]]
    assert set(m) == {"pid", "index", "inputs_pretokenized"}
  short, _ = arrays.load_task_inputs("test_msmarco_qg", "train", 16)
  assert short.shape == (len(pids), 16) and (short[:, -1] == EOS).all()


def _tiny_dir(root, passage):
  os.makedirs(root, exist_ok=True)
  files = {"collection.tsv": f"5\t{passage}\n", "queries.train.tsv": "9\tq?\n",
           "qrels.train.tsv": "9\t0\t5\t1\n", "queries.dev.tsv": "8\tq\n",
           "qrels.dev.tsv": "8\t0\t5\t1\n"}
  for name, text in files.items():
    with open(os.path.join(root, name), "w") as f:
      f.write(text)
  return str(root)


def test_reregistration_replaces_and_gin_configures(tmp_path):
  name = "test_msmarco_qg_tiny"
  try:
    msmarco_tasks.register_msmarco_query_generation(
        data_dir=_tiny_dir(tmp_path / "a", "alpha"), task_name=name)
    gin.parse_config([
        f"register_msmarco_query_generation.data_dir = '{_tiny_dir(tmp_path / 'b', 'beta')}'",
        f"register_msmarco_query_generation.task_name = '{name}'",
    ])
    assert tasks.register_tasks(semparse_tasks=False, multidogo_tasks=False,
                                msmarco_dual_encoder=False,
                                textcls_tasks=False) == [name]
    ds = seqio.get_mixture_or_task(name).get_dataset(
        LENGTHS, split="train", shuffle=False)
    [ex] = list(ds.as_numpy_iterator())
    assert ex["inputs_pretokenized"] == b"generate_query: beta"
  finally:
    gin.clear_config()
    seqio.TaskRegistry.remove(name)


def test_a_changed_qrels_file_is_counted_again(tmp_path):
  """Registration counts the examples once per version of the qrels file:
  a row added (or the file replaced) is counted at the next registration."""
  name = "test_msmarco_qg_counted"
  data_dir = _tiny_dir(tmp_path, "alpha")
  try:
    count = lambda: msmarco_tasks.register_msmarco_query_generation(
        data_dir=data_dir, task_name=name).num_input_examples("train")
    assert count() == count() == 1
    with open(os.path.join(data_dir, "qrels.train.tsv"), "a") as f:
      f.write("9\t0\t6\t1\n9\t0\t7\t0\n")  # one relevant row more
    assert count() == 2
    os.replace(_tiny_dir(tmp_path / "other", "beta") + "/qrels.dev.tsv",
               os.path.join(data_dir, "qrels.train.tsv"))
    assert count() == 1
  finally:
    seqio.TaskRegistry.remove(name)


def test_registration_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope"):
    msmarco_tasks.register_msmarco_query_generation(
        data_dir=str(tmp_path / "nope"), task_name="test_never")
  with pytest.raises(FileNotFoundError, match="SentencePiece"):
    msmarco_tasks.register_msmarco_query_generation(
        vocabulary_path=str(tmp_path / "x.model"), task_name="test_never")
  assert "test_never" not in seqio.TaskRegistry.names()
