"""ByteLevelBPEVocabulary and vocabulary_from_files.

GPT-2-format files (vocab.json + merges.txt, `<|endoftext|>` last, as in
GPT-2) are trained here on the embedded MSMARCO sample, so nothing is
downloaded. Ids are checked against two independent tokenizers: transformers'
GPT2TokenizerFast loading the same directory, and OpenAI's original GPT-2
BPE algorithm (encoder.py, re-typed below in pure Python).
"""
import functools
import json
import os
import pickle
import shutil

import numpy as np
import pytest
import regex
import seqio
import sentencepiece as spm
import tensorflow as tf

from dpjax.data import vocabularies
from dpjax.data.vocabularies import ByteLevelBPEVocabulary, vocabulary_from_files
from dpjax.data.readers import msmarco

SAMPLE = msmarco.DEFAULT_SAMPLE_DIR
SPM_MODEL = os.path.join(SAMPLE, "spm", "msmarco_sample.model")
EOS = "<|endoftext|>"
BASE_SIZE = 500  # 499 BPE tokens + <|endoftext|>

TEXTS = [
    "Hello world!",
    "!!! ?!",
    " leading space",
    "trailing space ",
    "  two  spaces  inside   and at both ends  ",
    "line one\nline two\r\n\tindented\n\n",
    "digits 0123456789, 3.14159 and 1548-1759; 10,000",
    "unicode: café naïve Zürich — “quotes” ‘single’ 日本語 Ελληνικά",
    "emoji 🙂 family 👩‍👩‍👧 combining e\u0301 nbsp\u00a0x zero\u200bwidth",
    "it's they're we'll I'd you've I'm don't",
    "",
    " ",
    "\n",
    "The town of Runodrasport lies in the Tiacaelo region.",
    "who established the settlement of runodrasport?",
]


def _collection_texts():
  with open(os.path.join(SAMPLE, "collection.tsv"), encoding="utf-8") as f:
    return [line.rstrip("\n").split("\t", 1)[1] for line in f]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  """A checkpoint-like directory with GPT-2-format vocab.json + merges.txt."""
  from tokenizers import ByteLevelBPETokenizer
  tok = ByteLevelBPETokenizer()  # add_prefix_space=False, like GPT-2
  tok.train_from_iterator(_collection_texts(), vocab_size=BASE_SIZE - 1,
                          min_frequency=2, show_progress=False)
  d = tmp_path_factory.mktemp("gpt2_bpe")
  tok.save_model(str(d))
  with open(d / "vocab.json", encoding="utf-8") as f:
    vocab = json.load(f)
  assert len(vocab) == BASE_SIZE - 1 and vocab["!"] == 0
  vocab[EOS] = len(vocab)  # GPT-2's layout: the 256 bytes first, EOS last
  with open(d / "vocab.json", "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False)
  return d


@pytest.fixture(scope="module")
def vocab(bpe_dir):
  return ByteLevelBPEVocabulary(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"))


@pytest.fixture(scope="module")
def hf(bpe_dir):
  transformers = pytest.importorskip("transformers")
  # transformers 5 ignores `vocab_file=`/`merges_file=` keywords (an empty
  # model!); loading the directory is the checkpoint path anyway.
  h = transformers.GPT2TokenizerFast.from_pretrained(str(bpe_dir))
  assert len(h) == BASE_SIZE and h.eos_token_id == BASE_SIZE - 1
  return h


# OpenAI's GPT-2 encoder.py (the reference algorithm), independent of `tokenizers`.
def _bytes_to_unicode():
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


class _ReferenceGPT2:

  PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

  def __init__(self, directory):
    with open(directory / "vocab.json", encoding="utf-8") as f:
      self.encoder = json.load(f)
    self.decoder = {v: k for k, v in self.encoder.items()}
    with open(directory / "merges.txt", encoding="utf-8") as f:
      merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    self.ranks = {m: i for i, m in enumerate(merges)}
    self.byte_encoder = _bytes_to_unicode()
    self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}

  @functools.lru_cache(maxsize=None)
  def bpe(self, token):
    word = tuple(token)
    while len(word) > 1:
      pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
      best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
      if best not in self.ranks:
        break
      first, second = best
      new, i = [], 0
      while i < len(word):
        if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
          new.append(first + second)
          i += 2
        else:
          new.append(word[i])
          i += 1
      word = tuple(new)
    return word

  def encode(self, text):
    ids = []
    for piece in regex.findall(self.PAT, text):
      piece = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
      ids.extend(self.encoder[t] for t in self.bpe(piece))
    return ids

  def decode(self, ids):
    text = "".join(self.decoder[i] for i in ids)
    return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------


def test_encode_decode_match_gpt2_tokenizer_fast(vocab, hf):
  for s in TEXTS + _collection_texts()[:50]:
    ids = vocab.encode(s)
    assert ids == hf.encode(s, add_special_tokens=False), s
    assert vocab.decode(ids) == hf.decode(ids) == s, s


def test_encode_decode_match_reference_algorithm(vocab, bpe_dir):
  ref = _ReferenceGPT2(bpe_dir)
  texts = TEXTS + _collection_texts()[:200]
  for s in texts:
    ids = vocab.encode(s)
    assert ids == ref.encode(s), s
    assert vocab.decode(ids) == ref.decode(ids) == s, s
  # The trained merges are actually exercised (not byte-by-byte encoding).
  joined = " ".join(texts)
  assert len(vocab.encode(joined)) < 0.6 * len(joined.encode("utf-8"))


def test_eos_pad_unk_and_size(vocab, hf, bpe_dir):
  with open(bpe_dir / "vocab.json", encoding="utf-8") as f:
    eos = json.load(f)[EOS]
  assert vocab.eos_id == eos == BASE_SIZE - 1 == hf.eos_token_id
  assert vocab.pad_id == vocab.eos_id == vocab.bos_id  # not 0: 0 is "!"
  assert vocab.encode("!") == [0]
  assert vocab.unk_id is None
  assert vocab.vocab_size == BASE_SIZE and vocab.extra_ids == 0
  assert vocab.token_id(EOS) == eos
  # The EOS text is the EOS token, as in GPT2TokenizerFast.
  assert vocab.encode(f"a{EOS}b") == hf.encode(f"a{EOS}b") == [*vocab.encode("a"), eos,
                                                               *vocab.encode("b")]


def test_decode_stops_at_eos_and_drops_unknown_ids(vocab):
  ab, cd = vocab.encode("ab"), vocab.encode(" cd")
  e = vocab.eos_id
  assert vocab.decode(ab + [e] + cd) == "ab"
  assert vocab.decode(ab + [e, e, e]) == "ab"  # eos padding
  assert vocab.decode([e] + ab) == ""
  assert vocab.decode(np.array(ab + cd + [BASE_SIZE + 7, -1])) == "ab cd"
  assert vocab.decode(tf.constant(ab + cd + [e, 0, 0])) == "ab cd"


def test_extra_tokens(bpe_dir, hf):
  extras = ["<REDACTED>", "<label:positive>", "<label:negative>"]
  v = ByteLevelBPEVocabulary(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"),
                             extra_tokens=extras)
  assert [v.token_id(t) for t in extras] == [BASE_SIZE, BASE_SIZE + 1, BASE_SIZE + 2]
  assert v.vocab_size == BASE_SIZE + 3 and v.extra_ids == 3 and v._base_vocab_size == BASE_SIZE
  assert v.eos_id == v.pad_id == BASE_SIZE - 1
  for t in extras:
    assert v.encode(t) == [v.token_id(t)]
    assert v.decode([v.token_id(t)]) == t
  s = "Ilsa<REDACTED>, a stonemason <REDACTED> in 1548.<label:positive>\n<label:negative>"
  ids = v.encode(s)
  r, pos, neg = (v.token_id(t) for t in extras)
  expected = (v.encode("Ilsa") + [r] + v.encode(", a stonemason ") + [r]
              + v.encode(" in 1548.") + [pos] + v.encode("\n") + [neg])
  assert ids == expected  # never split, and the text around is encoded as is
  assert v.decode(ids) == s
  # Same as GPT2TokenizerFast with the tokens added as special tokens.
  transformers = pytest.importorskip("transformers")
  h = transformers.GPT2TokenizerFast.from_pretrained(str(bpe_dir))
  h.add_special_tokens({"additional_special_tokens": extras})
  assert h.encode(s, add_special_tokens=False) == ids
  # The plain vocabulary splits them (so the ids above are not a coincidence).
  assert len(ByteLevelBPEVocabulary(str(bpe_dir / "vocab.json"),
                                    str(bpe_dir / "merges.txt")).encode("<REDACTED>")) > 1
  assert hf.encode("<REDACTED>") != [BASE_SIZE]


@pytest.mark.parametrize("kwargs, match", [
    ({"extra_tokens": ["!"]}, "already in the vocabulary"),
    ({"extra_tokens": [EOS]}, "already in the vocabulary"),
    ({"extra_tokens": ["<X>", "<X>"]}, "given twice"),
    ({"extra_tokens": [""]}, "empty"),
    ({"eos_token": "</s>"}, "not in"),
])
def test_bad_arguments(bpe_dir, kwargs, match):
  with pytest.raises(ValueError, match=match):
    ByteLevelBPEVocabulary(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"), **kwargs)


def test_bad_files(bpe_dir, tmp_path):
  with pytest.raises(FileNotFoundError):
    ByteLevelBPEVocabulary(str(tmp_path / "nope.json"), str(bpe_dir / "merges.txt"))
  (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, EOS: 2}))
  with pytest.raises(ValueError, match="exactly 0..1"):
    ByteLevelBPEVocabulary(str(tmp_path / "vocab.json"), str(bpe_dir / "merges.txt"))


def test_tf_ops_match_python(vocab):
  texts = TEXTS[:10]
  for s in texts:
    got = vocab.encode_tf(tf.constant(s))
    assert got.dtype == tf.int32 and got.shape.rank == 1
    assert got.numpy().tolist() == vocab.encode(s)
  ragged = vocab.encode_tf(tf.constant(texts))
  assert isinstance(ragged, tf.RaggedTensor) and ragged.dtype == tf.int32
  assert ragged.to_list() == [vocab.encode(s) for s in texts]
  grid = vocab.encode_tf(tf.constant([texts[:3], texts[3:6]]))
  assert grid.shape[:2] == [2, 3]
  assert grid.to_list() == [[vocab.encode(s) for s in texts[:3]],
                            [vocab.encode(s) for s in texts[3:6]]]

  e = vocab.eos_id
  rows = [vocab.encode(s)[:12] for s in texts]
  width = max(map(len, rows)) + 2
  padded = np.array([r + [e] + [0] * (width - len(r) - 1) for r in rows], np.int32)
  out = vocab.decode_tf(tf.constant(padded))
  assert out.shape == [len(texts)]
  assert [x.decode("utf-8") for x in out.numpy()] == [vocab.decode(r) for r in rows]
  assert vocab.decode_tf(tf.constant(padded[0])).numpy().decode() == vocab.decode(rows[0])

  @tf.function(input_signature=[tf.TensorSpec([], tf.string)])
  def graph_encode(s):
    return vocab.encode_tf(s)
  assert graph_encode(tf.constant(texts[7])).numpy().tolist() == vocab.encode(texts[7])


def test_seqio_task_tokenizes_like_direct_encode(vocab):
  texts = TEXTS[:-2] + _collection_texts()[:20]
  texts = [t for t in texts if t]  # a task's text feature may be empty, but keep it simple

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({"targets": texts})

  name = "test_vocabularies_bpe_task"
  seqio.TaskRegistry.remove(name)
  task = seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
      output_features={"targets": seqio.Feature(vocabulary=vocab, add_eos=True)})
  try:
    ds = task.get_dataset(None, split="train", shuffle=False, use_cached=False)
    got = [ex["targets"].tolist() for ex in ds.as_numpy_iterator()]
  finally:
    seqio.TaskRegistry.remove(name)
  assert got == [vocab.encode(t) + [vocab.eos_id] for t in texts]
  assert [vocab.decode(ids) for ids in got] == texts


def test_equality_hash_and_pickle(bpe_dir, tmp_path, vocab):
  shutil.copy(bpe_dir / "vocab.json", tmp_path / "vocab.json")
  shutil.copy(bpe_dir / "merges.txt", tmp_path / "merges.txt")
  copy = ByteLevelBPEVocabulary(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
  assert copy == vocab and hash(copy) == hash(vocab)
  extra = ByteLevelBPEVocabulary(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"),
                                 extra_tokens=["<R>"])
  assert extra != vocab and vocab != seqio.PassThroughVocabulary(BASE_SIZE)
  restored = pickle.loads(pickle.dumps(extra))
  assert restored == extra
  assert restored.encode("a<R>b") == extra.encode("a<R>b") == [*extra.encode("a"), BASE_SIZE,
                                                               *extra.encode("b")]


def test_reads_gfile_paths(bpe_dir, vocab):
  """Non-local paths (gs://... in practice) go through tf.io.gfile."""
  root = "ram://test_vocabularies_bpe"
  tf.io.gfile.makedirs(root)
  for name in ("vocab.json", "merges.txt"):
    tf.io.gfile.copy(str(bpe_dir / name), f"{root}/{name}", overwrite=True)
  remote = ByteLevelBPEVocabulary(f"{root}/vocab.json", f"{root}/merges.txt")
  assert remote == vocab
  assert remote.encode(TEXTS[7]) == vocab.encode(TEXTS[7])


def test_vocabulary_from_files_dispatch(bpe_dir, tmp_path, vocab):
  from dpjax.pretrained import tokenizer_files
  sp_vocab = vocabulary_from_files({"sentencepiece": SPM_MODEL})
  assert isinstance(sp_vocab, seqio.SentencePieceVocabulary)
  sp = spm.SentencePieceProcessor(model_file=SPM_MODEL)
  text = "who established the settlement of runodrasport?"
  assert list(sp_vocab.encode(text)) == sp.encode(text)
  assert vocabulary_from_files({"sentencepiece": SPM_MODEL}, extra_ids=3).vocab_size == (
      sp.get_piece_size() + 3)

  files = tokenizer_files(bpe_dir)  # as the trainer gets them from a checkpoint
  assert set(files) == {"vocab", "merges"}
  bpe = vocabulary_from_files(files)
  assert isinstance(bpe, ByteLevelBPEVocabulary) and bpe == vocab
  bpe_x = vocabulary_from_files(files, extra_tokens=["<REDACTED>"])
  assert bpe_x.vocab_size == BASE_SIZE + 1 and bpe_x.encode("<REDACTED>") == [BASE_SIZE]

  (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n")
  for bad, match in [({}, "found nothing"),
                     (tokenizer_files(tmp_path), "wordpiece=.*WordPiece"),
                     ({"vocab": files["vocab"]}, "vocab="),
                     ({**files, "sentencepiece": SPM_MODEL}, "both")]:
    with pytest.raises(ValueError, match=match):
      vocabulary_from_files(bad)


def test_module_docstring_states_pad_decision():
  doc = ByteLevelBPEVocabulary.__doc__
  assert "pad_id == eos_id" in doc and "lengths" in doc
  assert vocabularies.GPT2_EOS_TOKEN == EOS


def test_bpe_paths_prefer_given_then_checkpoint_then_defaults():
  ckpt = {"vocab": "/c/vocab.json", "merges": "/c/merges.txt"}
  kw = dict(default_vocab="/d/vocab.json", default_merges="/d/merges.txt")
  assert vocabularies.bpe_paths("/g/v.json", "/g/m.txt", ckpt, **kw) == (
      "/g/v.json", "/g/m.txt")
  assert vocabularies.bpe_paths(None, None, ckpt, **kw) == (
      "/c/vocab.json", "/c/merges.txt")
  assert vocabularies.bpe_paths(None, None, {"sentencepiece": "/c/s"}, **kw) == (
      "/d/vocab.json", "/d/merges.txt")
  with pytest.raises(ValueError, match="both bpe_vocab_path and bpe_merges_path"):
    vocabularies.bpe_paths("/g/v.json", None, None, **kw)
