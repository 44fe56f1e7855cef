"""Texts -> embeddings, and the resumable corpus encoder.

* `Tokenizer`: SentencePiece ids exactly as the seqio tasks make them
  (`tokenize` + `append_eos_after_trim`: ids cut to `length - 1`, EOS = 1
  appended, right padded with 0), without TensorFlow.
* `device_encode_fn`: a model's `encode(params, tokens)` jitted once, with the
  batch split over the mesh's data axes and the params replicated.
* `TextEncoder`: texts in fixed-shape batches (the last one padded), one
  batch on the device while the host tokenizes the next.
* `encode_corpus`: the corpus in shards of `shard_size` documents, each
  written atomically as `shard-00012-of-00880.npy` (float32 `[n, d]`) plus
  `shard-00012-of-00880.json` (its doc ids, shape and CRC-32). The JSON is
  written last, so it marks a finished shard; a restarted job validates each
  finished shard (ids, shape, checksum) and skips it, and recomputes a
  missing, half-written or corrupt one.
"""
from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import time
import zlib
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
import sentencepiece as spm

from dpjax import errors, fileio
from dpjax.training import partitioning, reporting

PAD_ID, EOS_ID = 0, 1  # T5's ids, those of every seqio task here


class Tokenizer:
  """A SentencePiece model turning texts into padded `int32[n, length]` rows,
  and generated rows back into texts."""

  def __init__(self, model_path: str):
    if not os.path.isfile(model_path):
      raise FileNotFoundError(f"SentencePiece model not found: {model_path!r}")
    self.path = model_path
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    if (self._sp.pad_id(), self._sp.eos_id()) != (PAD_ID, EOS_ID):
      raise ValueError(f"{model_path}: expected T5's pad id {PAD_ID} and EOS id "
                       f"{EOS_ID}, got {self._sp.pad_id()} and {self._sp.eos_id()}")

  def __call__(self, texts: Sequence[str], length: int) -> np.ndarray:
    rows = [ids[:length - 1] + [EOS_ID] for ids in self._sp.encode(list(texts))]
    lengths = np.array([len(r) for r in rows], np.int64)
    tokens = np.full((len(rows), length), PAD_ID, np.int32)
    tokens[np.arange(length) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), np.int32, count=int(lengths.sum()))
    return tokens

  def decode(self, tokens: np.ndarray) -> list[str]:
    """Each row's text up to its first EOS. Ids the model has but the
    SentencePiece model lacks (a pretrained T5's sentinel rows) read as
    unknown pieces, as seqio decodes them."""
    size, unk = self._sp.get_piece_size(), self._sp.unk_id()
    out = []
    for row in np.asarray(tokens).tolist():
      row = row[:row.index(EOS_ID)] if EOS_ID in row else row
      out.append(self._sp.decode([t if t < size else unk for t in row]))
    return out


def device_encode_fn(encode: Callable[[Any, jax.Array], jax.Array], params,
                     mesh: jax.sharding.Mesh | None = None
                     ) -> Callable[[np.ndarray], jax.Array]:
  """`tokens -> embeddings` on the devices: `encode(params, tokens)` jitted
  once per token shape, tokens and embeddings split along the batch over the
  mesh (all local devices by default), params replicated.

  The result is not waited for, so the host can prepare the next batch; the
  batch size must be a multiple of `partitioning.data_parallel_size(mesh)`.
  """
  mesh = mesh or partitioning.make_mesh()
  rows = partitioning.batch_sharding(mesh, 2)
  params = jax.device_put(params, partitioning.replicated(mesh))
  jitted = jax.jit(encode, out_shardings=rows)
  return lambda tokens: jitted(params, jax.device_put(tokens, rows))


@dataclasses.dataclass(frozen=True)
class TextEncoder:
  """Texts -> float32 `[n, d]` embeddings in fixed `[batch_size, length]`
  token batches, so `encode_fn` sees one shape (one compilation)."""
  encode_fn: Callable[[np.ndarray], Any]  # int32[batch, length] -> [batch, d]
  tokenizer: Callable[[Sequence[str], int], np.ndarray]
  length: int
  batch_size: int

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    if not texts:
      raise ValueError("no texts to encode")
    outputs, in_flight = [], None
    for start in range(0, len(texts), self.batch_size):
      chunk = texts[start:start + self.batch_size]
      tokens = np.zeros((self.batch_size, self.length), np.int32)
      tokens[:len(chunk)] = self.tokenizer(chunk, self.length)
      result = self.encode_fn(tokens)
      if in_flight is not None:
        outputs.append(np.asarray(in_flight, np.float32))
      in_flight = result
    outputs.append(np.asarray(in_flight, np.float32))
    embeddings = np.concatenate(outputs)[:len(texts)]
    if embeddings.ndim != 2 or not np.isfinite(embeddings).all():
      raise ValueError(f"the encoder gave non-finite or non-[n, d] embeddings "
                       f"(shape {embeddings.shape})")
    return embeddings


# ---------------------------------------------------------------------------
# Sharded, resumable corpus embeddings.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shard:
  """One finished shard: documents `start .. start + len(ids) - 1`."""
  index: int
  start: int
  ids: list[str]
  path: str  # the .npy file

  def load(self) -> np.ndarray:
    """The `[len(ids), d]` embeddings, memory-mapped (read as used)."""
    return np.load(self.path, mmap_mode="r")


_NOT_WRITTEN = "not written yet"


def _shard_name(index: int, num_shards: int) -> str:
  return f"shard-{index:05d}-of-{num_shards:05d}"


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(1 << 24):
      crc = zlib.crc32(block, crc)
  return crc


def _save_npy_atomic(path: str, array: np.ndarray) -> int:
  """Writes `array` as .npy atomically; returns the file's CRC-32."""
  buffer = io.BytesIO()
  np.save(buffer, array)
  with fileio.open_atomic(path, "wb") as f:
    f.write(buffer.getbuffer())
  return zlib.crc32(buffer.getbuffer())


def _finished_shard(base: str, index: int, num_shards: int, start: int,
                    ids: list[str]) -> tuple[Shard | None, str]:
  """The shard at `base`.{npy,json} if it is finished and valid, else why not."""
  try:
    with open(base + ".json", encoding="utf-8") as f:
      manifest = json.load(f)
  except FileNotFoundError:
    return None, _NOT_WRITTEN
  except (OSError, ValueError) as e:
    return None, f"unreadable manifest ({e})"
  expected = {"shard": index, "num_shards": num_shards, "start": start, "ids": ids}
  if not isinstance(manifest, dict) or any(manifest.get(k) != v
                                           for k, v in expected.items()):
    return None, "manifest does not match the corpus"
  try:
    if _crc32(base + ".npy") != manifest.get("crc32"):
      return None, "checksum mismatch"
    array = np.load(base + ".npy", mmap_mode="r")
  except (OSError, ValueError) as e:
    return None, f"unreadable embeddings ({e})"
  if array.dtype != np.float32 or array.shape != (len(ids), manifest.get("dim")):
    return None, f"embeddings of shape {array.shape} {array.dtype}"
  return Shard(index, start, ids, base + ".npy"), ""


def encode_corpus(docs: Iterable[tuple[str, str]], num_docs: int, out_dir: str,
                  embed: Callable[[list[str]], np.ndarray], *, shard_size: int,
                  fingerprint: dict, log: Callable[[str], None] = reporting.say
                  ) -> list[Shard]:
  """Embeds a corpus into `out_dir` shard by shard; resumes a previous run.

  Args:
    docs: `(doc id, text)` in corpus order (streamed; only one shard's texts
      are held at a time).
    num_docs: how many `docs` yields (names the shards and checks the stream).
    out_dir: the embeddings directory. Its `spec.json` records `num_docs`,
      `shard_size` and `fingerprint`; a directory made for another corpus,
      shard size or encoder is refused rather than mixed.
    embed: texts -> float32 `[n, d]` (e.g. a `TextEncoder`); only called for
      shards that are not finished.
    shard_size: documents per shard (the last one may hold fewer).
    fingerprint: JSON-able identity of the encoder (model dir, step,
      vocabulary, length).
    log: progress lines.

  Returns:
    The shards in corpus order.
  """
  if shard_size < 1 or num_docs < 1:
    raise ValueError(f"need shard_size >= 1 and num_docs >= 1, got {shard_size} "
                     f"and {num_docs}")
  os.makedirs(out_dir, exist_ok=True)
  spec = {"num_docs": num_docs, "shard_size": shard_size, "fingerprint": fingerprint}
  spec_path = os.path.join(out_dir, "spec.json")
  if os.path.isfile(spec_path):
    with open(spec_path, encoding="utf-8") as f:
      previous = json.load(f)
    if previous != json.loads(json.dumps(spec)):
      raise errors.UsageError(
          f"{out_dir} holds embeddings made with {previous}, not {spec}: use "
          "another output directory")
  else:
    fileio.write_atomic(spec_path, json.dumps(spec, indent=1) + "\n")

  num_shards = -(-num_docs // shard_size)
  docs = iter(docs)
  shards, dim = [], None
  start_time, encoded = time.perf_counter(), 0
  for index in range(num_shards):
    start = index * shard_size
    chunk = list(itertools.islice(docs, shard_size))
    if len(chunk) != min(shard_size, num_docs - start):
      raise ValueError(f"the corpus ended after {start + len(chunk)} documents; "
                       f"expected {num_docs} (did it change?)")
    ids = [doc_id for doc_id, _ in chunk]
    base = os.path.join(out_dir, _shard_name(index, num_shards))
    shard, why = _finished_shard(base, index, num_shards, start, ids)
    if shard is None:
      embeddings = np.ascontiguousarray(embed([text for _, text in chunk]),
                                        np.float32)
      if embeddings.shape[0] != len(ids) or (dim and embeddings.shape[1] != dim):
        raise ValueError(f"embed gave shape {embeddings.shape} for {len(ids)} "
                         f"texts (dimension so far: {dim})")
      crc = _save_npy_atomic(base + ".npy", embeddings)
      fileio.write_atomic(base + ".json", json.dumps({
          "shard": index, "num_shards": num_shards, "start": start,
          "dim": embeddings.shape[1], "crc32": crc, "ids": ids}) + "\n")
      shard = Shard(index, start, ids, base + ".npy")
      encoded += len(ids)
      rate = encoded / (time.perf_counter() - start_time)
      what = "encoded" if why == _NOT_WRITTEN else f"re-encoded ({why})"
      log(f"shard {index + 1}/{num_shards} {what}: {start + len(ids):,}/"
          f"{num_docs:,} documents, {rate:,.0f} docs/s, ~"
          f"{(num_docs - start - len(ids)) / rate / 60:,.1f} min to go")
    else:
      log(f"shard {index + 1}/{num_shards} already encoded")
    shard_dim = shard.load().shape[1]
    if dim not in (None, shard_dim):
      raise ValueError(f"{shard.path}: dimension {shard_dim}, others {dim}")
    dim = shard_dim
    shards.append(shard)
  if next(docs, None) is not None:
    raise ValueError(f"the corpus has more than the {num_docs} documents expected "
                     "(did it change?)")
  return shards

