"""The pretraining task (tasks.pretraining) and its corpus reader
(dpjax.data.readers.text_corpus): examples checked against the tokenizer and the
span-corruption functions called directly."""
import json

import numpy as np
import pytest

from dpjax.data import span_corruption
from dpjax.data.readers import malformed, text_corpus
from tasks import pretraining

DOCS = ["The river Olmaska runs north of the town.",
        "Who invented the brass spindle?",
        "A dish of rice, fennel and smoked fish, served cold in summer."]


def _corpus(path, train=DOCS, validation=DOCS[:1]):
  path.mkdir(parents=True, exist_ok=True)
  for split, docs in (("train", train), ("validation", validation)):
    (path / f"{split}.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs))
  return path


def test_reader_keeps_order_and_ignores_other_fields(tmp_path):
  f = tmp_path / "c.jsonl"
  f.write_text('{"text": "a b", "url": "x"}\n\n{"text": "c"}\n')
  assert text_corpus.read_documents(str(f)) == ["a b", "c"]


@pytest.mark.parametrize("line,why", [
    ("not json", "not valid JSON"), ('["text"]', "JSON object"),
    ('{"text": ""}', "non-empty string"), ('{"txt": "a"}', "non-empty string")])
def test_reader_malformed_lines(tmp_path, line, why):
  f = tmp_path / "c.jsonl"
  f.write_text('{"text": "ok"}\n' + line + "\n")
  with pytest.raises(malformed.MalformedLineError, match=f":2: .*{why}"):
    text_corpus.read_documents(str(f))
  assert text_corpus.read_documents(str(f), "skip") == ["ok"]


def test_reader_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="corpus file not found"):
    text_corpus.read_documents(str(tmp_path / "none.jsonl"))


def test_tokenizer_files_by_kind(tmp_path):
  spm = pretraining.PATHS_ABS["MSMARCO_SPM"]
  assert pretraining.tokenizer_files(spm) == {"sentencepiece": spm}
  bpe = pretraining.PATHS_ABS["MULTIDOGO_BPE"]
  assert set(pretraining.tokenizer_files(bpe)) == {"vocab", "merges"}
  with pytest.raises(FileNotFoundError, match="SentencePiece .model file"):
    pretraining.tokenizer_files(str(tmp_path))


def _arrays(name, split="train"):
  import seqio
  ds = seqio.get_mixture_or_task(name).get_dataset(
      None, split=split, shuffle=False)
  return [{k: v.numpy().tolist() for k, v in ex.items()} for ex in ds]


def test_span_corruption_task(tmp_path):
  import seqio
  task = pretraining.register_pretraining_task(
      name="test_span", corpus_dir=str(_corpus(tmp_path)),
      tokenizer=pretraining.PATHS_ABS["MSMARCO_SPM"], extra_ids=10,
      segment_length=8, copies=2, seed=3)
  vocab = seqio.SentencePieceVocabulary(pretraining.PATHS_ABS["MSMARCO_SPM"],
                                        extra_ids=10)
  assert task.output_features["inputs"].vocabulary.vocab_size == 2010
  want = []
  for copy in range(2):
    for d, doc in enumerate(DOCS):
      ids = np.array(vocab.encode(doc))
      for s, start in enumerate(range(0, len(ids), 8)):
        seg = ids[start:start + 8]
        if len(seg) < 2:
          continue
        mask = span_corruption.noise_mask(
            len(seg), 0.15, 3.0, np.random.default_rng([3, copy, d, s]))
        x, y = span_corruption.corrupt(seg, mask, 2010)
        want.append((x.tolist() + [1], y.tolist() + [1]))  # + EOS
  got = [(e["inputs"], e["targets"]) for e in _arrays("test_span")]
  assert got == want
  # The sentinels are the extra ids; the validation split has one copy.
  assert max(max(x) for x, _ in got) >= 2000
  assert len(_arrays("test_span", "validation")) * 2 <= len(got)


def test_causal_lm_task_chunks_documents_with_eos(tmp_path):
  from dpjax.data import vocabularies
  bpe = pretraining.tokenizer_files(pretraining.PATHS_ABS["MULTIDOGO_BPE"])
  pretraining.register_pretraining_task(
      name="test_clm", objective="causal_lm", corpus_dir=str(_corpus(tmp_path)),
      tokenizer=pretraining.PATHS_ABS["MULTIDOGO_BPE"], chunk_length=7)
  vocab = vocabularies.ByteLevelBPEVocabulary(bpe["vocab"], bpe["merges"])
  stream = sum((vocab.encode(d) + [vocab.eos_id] for d in DOCS), [])
  got = _arrays("test_clm")
  assert all(e["inputs"] == [] for e in got)
  assert [len(e["targets"]) for e in got[:-1]] == [7] * (len(got) - 1)
  assert sum((e["targets"] for e in got), []) == stream
  assert vocab.decode(got[0]["targets"]) == DOCS[0][:len(vocab.decode(
      got[0]["targets"]))]


def test_registration_errors(tmp_path):
  corpus = str(_corpus(tmp_path))
  with pytest.raises(ValueError, match="objective must be one of"):
    pretraining.register_pretraining_task(
        name="x", objective="mlm", corpus_dir=corpus,
        tokenizer=pretraining.PATHS_ABS["MSMARCO_SPM"])
  with pytest.raises(ValueError, match="span corruption needs a SentencePiece"):
    pretraining.register_pretraining_task(
        name="x", corpus_dir=corpus,
        tokenizer=pretraining.PATHS_ABS["MULTIDOGO_BPE"])
  with pytest.raises(FileNotFoundError, match="validation.jsonl"):
    (tmp_path / "validation.jsonl").unlink()
    pretraining.register_pretraining_task(
        name="x", corpus_dir=corpus,
        tokenizer=pretraining.PATHS_ABS["MSMARCO_SPM"])
  assert pretraining.register_pretraining_task() is None  # no name: nothing
