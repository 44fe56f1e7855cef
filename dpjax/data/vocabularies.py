"""seqio vocabularies for the tokenizer files that come with a checkpoint.

`dpjax.pretrained.tokenizer_files(path)` says which files a checkpoint
directory carries; `vocabulary_from_files` turns them into the task
vocabulary:

* `{"sentencepiece": spiece.model}` (T5) -> `seqio.SentencePieceVocabulary`;
* `{"vocab": vocab.json, "merges": merges.txt}` (GPT-2) ->
  `ByteLevelBPEVocabulary`, GPT-2's byte-level BPE through the Hugging Face
  `tokenizers` library, so ids are exactly those of `GPT2TokenizerFast`.

This is the data layer: TensorFlow and seqio are imported here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Mapping, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's info chatter, not ours
import numpy as np  # noqa: E402
import seqio  # noqa: E402
import tensorflow as tf  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers  # noqa: E402

GPT2_EOS_TOKEN = "<|endoftext|>"


def _read_bytes(path: str) -> bytes:
  if os.path.isfile(path):
    with open(path, "rb") as f:
      return f.read()
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f"Tokenizer file not found: {path!r}")
  with tf.io.gfile.GFile(path, "rb") as f:
    return f.read()


class ByteLevelBPEVocabulary(seqio.Vocabulary):
  """GPT-2's byte-level BPE (`vocab.json` + `merges.txt`) as a seqio vocabulary.

  Encoding is that of `transformers.GPT2TokenizerFast` with its defaults
  (`add_prefix_space=False`): a `tokenizers.Tokenizer` with the files' BPE
  model, the ByteLevel pre-tokenizer (GPT-2's split regex) and the ByteLevel
  decoder. `encode` adds no special tokens and no EOS (seqio's `add_eos`
  does that). Like GPT2TokenizerFast, the literal text `<|endoftext|>` in an
  input encodes as the EOS id. Every string round-trips:
  `decode(encode(s)) == s` (unless `s` contains the EOS text).

  Ids: `0 .. base_size - 1` are `vocab.json`'s (which must be exactly those
  ids, and must contain `eos_token`: 50257 entries, EOS 50256 for GPT-2);
  `extra_tokens[i]` gets id `base_size + i`. Extra tokens (e.g.
  `"<REDACTED>"`, the label tokens of conditional generation) are matched in
  the text before BPE, so they are never split, and decode to their text.
  `vocab_size == base_size + len(extra_tokens)` (seqio's `extra_ids` is the
  number of extra tokens). The model's embedding needs `vocab_size` rows; a
  pretrained GPT-2 embedding has 50257, so extra tokens need it extended.

  Decoding (seqio's contract): up through the first EOS; the EOS itself and
  everything after it are dropped (as SentencePiece drops T5's `</s>`).
  Ids outside `[0, vocab_size)` (e.g. the padded rows of an embedding)
  decode to nothing.

  pad_id == eos_id, not seqio's conventional 0. GPT-2 has no padding token,
  and id 0 is a real token (`"!"`), so no choice is free of collisions:
  * `pad_id = 0` would declare `"!"` to be padding. seqio's own uses of
    `pad_id` would then be wrong: `decode_tf` overwrites the ids after the
    first EOS with `pad_id` before detokenizing (they would read as
    `"!!!"`), and token counters (`seqio.beam_utils`) skip `pad_id`, so
    real `"!"` tokens would not be counted. Left padding with `pad_id` would
    decode as `"!"` rather than be cut.
  * `pad_id = eos_id` (Hugging Face's convention for GPT-2, and what
    `dpjax.generation.decoding.generate_causal` writes after a row's EOS): padding is a
    token the model knows as a boundary, `decode`/`decode_tf` cut it (so
    padding never turns into text), and excluding it from token counts only
    excludes EOS, which seqio excludes anyway.
  Either way, **masks must come from lengths, never from `token == pad_id`
  or `token != 0`**: EOS is a real target (the model must learn to stop),
  and seqio's `trim_and_pad` and feature converters pad with a literal 0
  whatever the vocabulary says, so the padded arrays hold `"!"`; the
  unpacked converters' `*_loss_weights = non_padding_position(x)` (`x != 0`)
  would then also zero the loss on every real `"!"` token. dpjax's GPT-2
  features carry explicit `loss_weights` and `attention_mask` built from
  lengths, and right padding needs no mask at all (attention is causal).

  In a tf.data pipeline (`seqio.preprocessors.tokenize`), `encode_tf` and
  `decode_tf` run the tokenizer through `tf.numpy_function`: they work in
  graph mode and in parallel maps, but the graph is not serialisable
  (no SavedModel export, no tf.data service).
  """

  def __init__(self, vocab_path: str, merges_path: str, *,
               eos_token: str = GPT2_EOS_TOKEN,
               extra_tokens: Sequence[str] = ()):
    """Reads the files (local or any `tf.io.gfile` path).

    Args:
      vocab_path: GPT-2's `vocab.json` ({token: id}, ids 0..n-1).
      merges_path: GPT-2's `merges.txt`.
      eos_token: the EOS token; must be in `vocab.json`.
      extra_tokens: special tokens appended after the vocabulary, in order.
        Must be distinct, non-empty and not already in `vocab.json`.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: the files or tokens do not satisfy the above.
    """
    self._vocab_path = os.fspath(vocab_path)
    self._merges_path = os.fspath(merges_path)
    self._eos_token = str(eos_token)
    self._extra_tokens = tuple(str(t) for t in extra_tokens)
    super().__init__(extra_ids=len(self._extra_tokens))

    vocab_bytes = _read_bytes(self._vocab_path)
    merges_bytes = _read_bytes(self._merges_path)
    try:
      vocab = json.loads(vocab_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{self._vocab_path!r} is not a JSON vocabulary: {e}") from e
    if not isinstance(vocab, dict) or not vocab:
      raise ValueError(f"{self._vocab_path!r} is not a {{token: id}} JSON object.")
    ids = sorted(vocab.values())
    if ids != list(range(len(vocab))):
      raise ValueError(
          f"{self._vocab_path!r}: ids must be exactly 0..{len(vocab) - 1} "
          f"(found {len(set(ids))} distinct ids in [{ids[0]}, {ids[-1]}]).")
    if self._eos_token not in vocab:
      raise ValueError(f"EOS token {self._eos_token!r} is not in {self._vocab_path!r}.")
    self._base_size = len(vocab)
    self._eos_id = int(vocab[self._eos_token])
    problems = []
    seen = set()
    for t in self._extra_tokens:
      if not t:
        problems.append("an empty extra token")
      elif t in vocab:
        problems.append(f"{t!r} is already in the vocabulary (id {vocab[t]})")
      elif t in seen:
        problems.append(f"{t!r} is given twice")
      seen.add(t)
    if problems:
      raise ValueError("Bad extra_tokens: " + "; ".join(problems))

    self._digest = hashlib.sha256(
        hashlib.sha256(vocab_bytes).digest() + hashlib.sha256(merges_bytes).digest()
    ).hexdigest()
    self._tokenizer = self._build_tokenizer(vocab_bytes, merges_bytes)

  def _build_tokenizer(self, vocab_bytes: bytes, merges_bytes: bytes
                       ) -> tokenizers.Tokenizer:
    # BPE.from_file (tokenizers' own parser of GPT-2's files) needs local
    # paths; remote files are copied to a temporary directory first.
    tmp = None
    vocab_file, merges_file = self._vocab_path, self._merges_path
    try:
      if not (os.path.isfile(vocab_file) and os.path.isfile(merges_file)):
        tmp = tempfile.mkdtemp(prefix="dpjax_bpe_")
        vocab_file = os.path.join(tmp, "vocab.json")
        merges_file = os.path.join(tmp, "merges.txt")
        for file, data in ((vocab_file, vocab_bytes), (merges_file, merges_bytes)):
          with open(file, "wb") as f:
            f.write(data)
      try:
        # GPT2TokenizerFast's model: no unk, no dropout, no subword affixes.
        bpe = models.BPE.from_file(vocab_file, merges_file, dropout=None,
                                   continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False)
      except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"Cannot read BPE files {self._vocab_path!r}, "
                         f"{self._merges_path!r}: {e}") from e
    finally:
      if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [tokenizers.AddedToken(t, special=True, normalized=False)
               for t in (self._eos_token, *self._extra_tokens)]
    tok.add_special_tokens(special)
    for i, t in enumerate(self._extra_tokens):
      if tok.token_to_id(t) != self._base_size + i:  # defensive: tokenizers' numbering
        raise ValueError(f"Extra token {t!r} got id {tok.token_to_id(t)}, "
                         f"expected {self._base_size + i}.")
    if tok.token_to_id(self._eos_token) != self._eos_id:
      raise ValueError(f"EOS token {self._eos_token!r} did not keep id {self._eos_id}.")
    return tok

  # -- seqio.Vocabulary properties ------------------------------------------

  @property
  def eos_id(self) -> int:
    """The id of `eos_token` in `vocab.json`."""
    return self._eos_id

  @property
  def pad_id(self) -> int:
    """The EOS id: GPT-2 has no padding token (see the class docstring)."""
    return self._eos_id

  @property
  def bos_id(self) -> int:
    """GPT-2 starts documents with `<|endoftext|>` too: the EOS id."""
    return self._eos_id

  @property
  def unk_id(self) -> None:
    """None: byte-level BPE encodes every string."""
    return None  # byte-level: every string is encodable.

  @property
  def _base_vocab_size(self) -> int:
    return self._base_size

  @property
  def extra_tokens(self) -> tuple[str, ...]:
    """The tokens appended after `vocab.json`'s, in id order."""
    return self._extra_tokens

  @property
  def tokenizer(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer` (do not modify it)."""
    return self._tokenizer

  def token_id(self, token: str) -> int:
    """The id of one token (a vocabulary entry or an extra token)."""
    i = self._tokenizer.token_to_id(token)
    if i is None:
      raise KeyError(f"{token!r} is not a token of this vocabulary.")
    return int(i)

  # -- Python -----------------------------------------------------------------

  def _encode(self, s: str) -> list[int]:
    if isinstance(s, bytes):
      s = s.decode("utf-8")
    return self._tokenizer.encode(s, add_special_tokens=False).ids

  def _decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if self._eos_id in ids:
      ids = ids[:ids.index(self._eos_id)]
    size = self.vocab_size
    return self._tokenizer.decode([i for i in ids if 0 <= i < size],
                                  skip_special_tokens=False)

  # -- TensorFlow -------------------------------------------------------------

  @staticmethod
  def _text(s) -> str:
    """A tf.numpy_function string (bytes, or a 0-d object array) as str."""
    if isinstance(s, np.ndarray):
      s = s.item()
    return s.decode("utf-8") if isinstance(s, bytes) else str(s)

  def _encode_np(self, s) -> np.ndarray:
    return np.asarray(self._encode(self._text(s)), np.int32)

  def _encode_batch_np(self, strings) -> tuple[np.ndarray, np.ndarray]:
    texts = [self._text(s) for s in np.asarray(strings, object).reshape(-1)]
    encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
    rows = [np.asarray(e.ids, np.int32) for e in encodings]
    values = np.concatenate(rows) if rows else np.zeros([0], np.int32)
    return values.astype(np.int32), np.asarray([len(r) for r in rows], np.int64)

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor | tf.RaggedTensor:
    """A scalar string -> 1-D int32 ids; rank r >= 1 -> int32 RaggedTensor of
    rank r + 1 (the last dimension ragged)."""
    s = tf.convert_to_tensor(s, tf.string)
    rank = s.shape.rank
    if rank is None:
      raise ValueError("encode_tf needs a string tensor of known rank.")
    if rank == 0:
      ids = tf.numpy_function(self._encode_np, [s], tf.int32, stateful=False)
      ids.set_shape([None])
      return ids
    values, lengths = tf.numpy_function(
        self._encode_batch_np, [tf.reshape(s, [-1])], [tf.int32, tf.int64],
        stateful=False)
    values.set_shape([None])
    lengths.set_shape([None])
    out = tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
    dims = tf.shape(s, out_type=tf.int64)
    for axis in range(rank - 1, 0, -1):
      out = tf.RaggedTensor.from_uniform_row_length(out, dims[axis], validate=False)
    return out

  def _decode_rows_np(self, ids) -> np.ndarray:
    return np.asarray([self._decode(row).encode("utf-8") for row in ids], object)

  def _decode_tf(self, ids: tf.Tensor | tf.RaggedTensor) -> tf.Tensor:
    """int ids `[..., L]` -> strings `[...]` (a 1-D input gives a scalar)."""
    if isinstance(ids, tf.RaggedTensor):
      ids = ids.to_tensor(default_value=self._eos_id)  # the padding is cut
    ids = tf.cast(tf.convert_to_tensor(ids), tf.int64)
    if ids.shape.rank is None or ids.shape.rank < 1:
      raise ValueError("decode_tf needs ids of known rank >= 1.")
    shape = tf.shape(ids)
    rows = tf.reshape(ids, [-1, shape[-1]])
    text = tf.numpy_function(self._decode_rows_np, [rows], tf.string, stateful=False)
    text.set_shape([None])
    return tf.reshape(text, shape[:-1])

  # -- identity ---------------------------------------------------------------

  def _key(self) -> tuple[Any, ...]:
    return (self._digest, self._eos_token, self._extra_tokens)

  def __eq__(self, other) -> bool:
    """Equal iff same file contents, EOS token and extra tokens (paths aside)."""
    if not isinstance(other, ByteLevelBPEVocabulary):
      return False
    return self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __str__(self) -> str:
    return (f"ByteLevelBPEVocabulary(vocab={self._vocab_path!r}, "
            f"merges={self._merges_path!r}, eos_id={self._eos_id}, "
            f"extra_tokens={list(self._extra_tokens)}, vocab_size={self.vocab_size})")

  __repr__ = __str__


def vocabulary_from_files(files: Mapping[str, str], **kwargs) -> seqio.Vocabulary:
  """The seqio vocabulary of a checkpoint's tokenizer files.

  Args:
    files: `dpjax.pretrained.tokenizer_files(path)`:
      `{"sentencepiece": p}` -> `seqio.SentencePieceVocabulary(p, **kwargs)`
      (e.g. `extra_ids=100` for T5's sentinels);
      `{"vocab": v, "merges": m}` -> `ByteLevelBPEVocabulary(v, m, **kwargs)`
      (e.g. `extra_tokens=["<REDACTED>"]`).
    **kwargs: passed to the vocabulary's constructor.

  Raises:
    ValueError: anything else (no files, BERT's WordPiece `vocab.txt`, a
      `vocab` without `merges`, or both kinds at once), naming what was found.
  """
  files = dict(files or {})
  has_sp = "sentencepiece" in files
  has_bpe = "vocab" in files and "merges" in files
  if has_sp and not has_bpe:
    return seqio.SentencePieceVocabulary(files["sentencepiece"], **kwargs)
  if has_bpe and not has_sp:
    return ByteLevelBPEVocabulary(files["vocab"], files["merges"], **kwargs)
  found = ", ".join(f"{k}={v!r}" for k, v in sorted(files.items())) or "nothing"
  why = "both SentencePiece and BPE files" if has_sp and has_bpe else "no supported tokenizer"
  hint = ("; WordPiece (BERT vocab.txt) has no seqio vocabulary here"
          if "wordpiece" in files else "")
  raise ValueError(
      f"Cannot make a vocabulary: {why} among the tokenizer files (found "
      f"{found}); expected {{'sentencepiece': spiece.model}} or "
      f"{{'vocab': vocab.json, 'merges': merges.txt}}{hint}.")


def bpe_paths(vocab_path: str | None, merges_path: str | None,
              checkpoint_files: Mapping[str, str] | None, *,
              default_vocab: str, default_merges: str) -> tuple[str, str]:
  """(vocab.json, merges.txt) of a GPT-2 task: the ones given (both or
  neither), else the pretrained checkpoint's if it has them, else the
  defaults (an embedded sample's)."""
  if bool(vocab_path) != bool(merges_path):
    raise ValueError("Set both bpe_vocab_path and bpe_merges_path, or neither.")
  files = dict(checkpoint_files or {})
  if vocab_path:
    return vocab_path, merges_path
  if "vocab" in files and "merges" in files:
    return files["vocab"], files["merges"]
  return default_vocab, default_merges
