"""t5x checkpoints -> dpjax T5 params, one tensor at a time.

The on-disk format, as read in google-research/t5x's source (`t5x/checkpoints.py`:
`Checkpointer.save`, `_write_state_to_tensorstore`, `_read_ts`,
`load_t5x_checkpoint`, VERSION = 3; `t5x/train_state.py`; and
`t5x/checkpoint_utils.py`: `detect_checkpoint_type`):

* a step directory `checkpoint_<step>/` holding a file named `checkpoint`: a
  msgpack document written by `flax.serialization` (`to_bytes`), read
  lazily by `flax_msgpack` (its docstring has the format).
* the document is `{'version': 3, 'optimizer': state}` (t5x `VERSION` >= 1),
  or the bare `state` for version 0 (a plain Flax checkpoint). `state` is the
  train state's `state_dict()`: `{'target': params, 'state': {'step': ...,
  'param_states': ...}}` plus an optional 'flax_mutables'.
* each leaf of `state` is either the array itself (written inline), or a
  reference to an array written with TensorStore next to the `checkpoint`
  file, one directory per array named by its path joined with '.' (e.g.
  `target.encoder.layers_0.attention.query.kernel`):
    - the t5x `Checkpointer` stores the serialized `tensorstore.Spec`, e.g.
      `{'driver': 'zarr', 'dtype': 'bfloat16', 'kvstore': {'driver': 'file',
      'path': 'target.encoder...'}, 'metadata': {'compressor': {'id':
      'gzip'}, 'shape': [...], 'chunks': [...]}}`, the path relative to the
      step directory (a 'gcs' kvstore with a dummy bucket when written to
      GCS; tensorstore < 0.1.14 kept 'path' at the top level);
    - orbax's PyTreeCheckpointHandler (behind t5x's `CheckpointManager`)
      stores the string
      `'PLACEHOLDER://<name>'` and the array lives in `<step dir>/<name>`
      (zarr, or inside an OCDBT database when the directory has a
      `manifest.ocdbt`).
* bfloat16 arrays are native tensorstore/zarr `bfloat16` since version 3;
  version 2 stored their bits as uint16, which this reader reinterprets
  (t5x itself refuses such checkpoints).

Parameter names: `open_t5x_checkpoint` exposes only the model params (the
'target' subtree), flattened with '/', relative to 'target'; e.g.
'encoder/layers_0/attention/query/kernel', 'token_embedder/embedding'. These
are exactly the paths of dpjax's T5 params, since dpjax uses t5x's names.
Optimizer state, step and flax mutables are never read.

Attention kernels: t5x's `t5x/examples/t5/layers.py` (DenseGeneral) stores
them 2-D (`[embed, joined_kv]`, `[joined_kv, embed]`) exactly like dpjax,
while `t5x/examples/scalable_t5/layers.py` stores them N-d (`[embed, heads,
kv]`, `[heads, kv, embed]`); both are accepted, the 3-D form is collapsed in
C order (which is how the 2-D form is reshaped inside t5x).

Not supported (raise CheckpointError): TensorFlow (Mesh TF) checkpoints,
orbax checkpoints without the msgpack `checkpoint` file, scanned-layer
(`scan_layers=True`) param trees, `gs://` paths (copy the step directory
locally first).

No TensorFlow; tensorstore is imported only when an array stored with it is
read.
"""
from __future__ import annotations

import json
import mmap
import os
import re
from typing import Any, Iterable, Mapping

import jax
import ml_dtypes
import numpy as np

from dpjax.models import hf_common
from dpjax.models.t5 import T5Config, abstract_params

from dpjax.pretrained import flax_msgpack
from dpjax.pretrained.flax_msgpack import ChunkedArray, InlineArray, Span
from dpjax.pretrained.tensor_files import CheckpointError

PyTree = Any

_CHECKPOINT_FILE = "checkpoint"
_STEP_DIR = re.compile(r"checkpoint_(\d+)$")
_PLACEHOLDER_PREFIXES = ("PLACEHOLDER://", "AGGREGATED://")
_ATTENTION_IN = ("query", "key", "value")
_MAX_LISTED = 20


# ----------------------------------------------------------------------------
# Locating checkpoints.
# ----------------------------------------------------------------------------


def _checkpoint_file(path) -> str | None:
  """The msgpack file of a step directory (or the file itself), else None."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, _CHECKPOINT_FILE)
  if os.path.basename(path) != _CHECKPOINT_FILE or not os.path.isfile(path):
    return None
  return path


def _state_of(contents: Mapping) -> tuple[int, Mapping]:
  """(version, train-state dict) of a decoded `checkpoint` file."""
  version = contents.get("version", 0)
  if not isinstance(version, int):
    version = 0
  state = contents["optimizer"] if version > 0 and "optimizer" in contents else contents
  return version, state


def is_t5x_checkpoint(path) -> bool:
  """Whether `path` is a t5x step directory or its `checkpoint` file.

  True for a directory (normally `checkpoint_<step>`) holding a file named
  `checkpoint`, or that file, when it is a msgpack map laid out as t5x writes
  it ({'version', 'optimizer'} or a bare {'target', ...} train state). False
  for anything else, including a t5x model directory holding several
  `checkpoint_<step>` directories and TensorFlow checkpoints.
  """
  file = _checkpoint_file(path)
  if file is None:
    return False
  keys = flax_msgpack.top_level_keys(file)
  if keys is None:
    return False
  return "optimizer" in keys or "target" in keys


def _steps_in(directory: str) -> list[int]:
  steps = []
  for name in os.listdir(directory):
    m = _STEP_DIR.match(name)
    if m and os.path.isfile(os.path.join(directory, name, _CHECKPOINT_FILE)):
      steps.append(int(m.group(1)))
  return sorted(steps)


# ----------------------------------------------------------------------------
# The reader.
# ----------------------------------------------------------------------------


def _is_ts_spec(x) -> bool:
  return (isinstance(x, dict) and isinstance(x.get("driver"), str)
          and ("kvstore" in x or "path" in x))


def _is_placeholder(x) -> bool:
  return isinstance(x, str) and x.startswith(_PLACEHOLDER_PREFIXES)


class T5xCheckpointReader:
  """`hf_common.TensorReader` over the params of one t5x checkpoint.

  Names are the '/'-joined paths inside the 'target' (params) subtree.
  `shape` and `dtype` come from metadata (the msgpack structure, the stored
  tensorstore spec, or the zarr `.zarray` file); `get` reads one array and
  returns it as float32. Use as a context manager, or call `close`.
  """

  def __init__(self, path):
    file = _checkpoint_file(path)
    if file is None:
      path = os.fspath(path)
      if os.path.isdir(path) and _steps_in(path):
        steps = _steps_in(path)
        raise CheckpointError(
            f"{path} is a t5x model directory with checkpoints for steps {steps}; "
            f"pass one step directory, e.g. {os.path.join(path, f'checkpoint_{steps[-1]}')}")
      raise CheckpointError(
          f"Not a t5x checkpoint: {path} (expected a checkpoint_<step> directory "
          "holding a msgpack file named 'checkpoint', or that file)")
    self.path = file
    self.directory = os.path.dirname(os.path.abspath(file))
    self._file = open(file, "rb")
    try:
      if self._file.read(21) == b"model_checkpoint_path":
        raise CheckpointError(
            f"{file} is a TensorFlow (Mesh TF) checkpoint index, not a t5x checkpoint; "
            "convert it with t5x first")
      size = os.fstat(self._file.fileno()).st_size
      if size == 0:
        raise CheckpointError(f"{file} is empty")
      self._buf = mmap.mmap(self._file.fileno(), size, access=mmap.ACCESS_READ)
      try:
        contents, end = flax_msgpack.MsgpackParser(self._buf).parse(0)
      except flax_msgpack.PARSE_ERRORS as e:
        raise CheckpointError(f"{file} is not a flax msgpack checkpoint: {e}") from e
      if end != size or not isinstance(contents, dict):
        raise CheckpointError(f"{file} is not a flax msgpack checkpoint")
      self.version, state = _state_of(flax_msgpack.unchunk(contents))
      if not isinstance(state, dict) or not isinstance(state.get("target"), dict):
        raise CheckpointError(
            f"{file} holds no 'target' (params) tree; top-level keys: "
            f"{sorted(map(str, contents))}"
            + (f", state keys: {sorted(map(str, state))}" if isinstance(state, dict) else ""))
    except BaseException:
      self.close()
      raise
    self._ocdbt = os.path.exists(os.path.join(self.directory, "manifest.ocdbt"))
    self._leaves: dict[str, Any] = {}
    self._flatten(state["target"], ())

  def _flatten(self, tree, prefix):
    for k, v in tree.items():
      path = prefix + (str(k),)
      if isinstance(v, dict) and not _is_ts_spec(v):
        self._flatten(v, path)
      elif v is not None:
        self._leaves["/".join(path)] = v

  # --- TensorReader -------------------------------------------------------

  def keys(self) -> Iterable[str]:
    """The '/'-joined names of the checkpoint's params."""
    return list(self._leaves)

  def __contains__(self, name) -> bool:
    return name in self._leaves

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of tensor `name`, from its metadata where there is any."""
    leaf = self._leaf(name)
    if isinstance(leaf, (InlineArray, ChunkedArray)):
      return leaf.shape
    if isinstance(leaf, (int, float, bool, np.number)):
      return ()
    meta = self._zarr_metadata(name, leaf)
    if meta is not None and "shape" in meta:
      return tuple(int(d) for d in meta["shape"])
    return tuple(int(d) for d in self._open_store(name, leaf).shape)

  def dtype(self, name: str) -> np.dtype:
    """The stored dtype (before the float32 upcast of `get`)."""
    leaf = self._leaf(name)
    if isinstance(leaf, (InlineArray, ChunkedArray)):
      return leaf.dtype
    if isinstance(leaf, (int, float, bool, np.number)):
      return np.asarray(leaf).dtype
    if _is_ts_spec(leaf) and isinstance(leaf.get("dtype"), str):
      return flax_msgpack.dtype_from_name(leaf["dtype"])
    return np.dtype(self._open_store(name, leaf).dtype.numpy_dtype)

  def get(self, name: str) -> np.ndarray:
    """Tensor `name` as float32; CheckpointError if not a float tensor."""
    leaf = self._leaf(name)
    if isinstance(leaf, (InlineArray, ChunkedArray)):
      try:
        x = flax_msgpack.read_array(self._buf, leaf)
      except ValueError as e:
        raise CheckpointError(f"{self.path}: {e}") from e
    elif isinstance(leaf, (int, float, bool, np.number)):
      x = np.asarray(leaf)
    else:
      x = np.asarray(self._open_store(name, leaf).read().result())
    if x.dtype == np.uint16 and self.version < 3:
      x = x.view(ml_dtypes.bfloat16)  # version 2 wrote bfloat16 bits as uint16
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16):
      raise CheckpointError(f"t5x tensor {name!r} has non-float dtype {x.dtype}")
    return np.asarray(x, np.float32)

  # --- internals ----------------------------------------------------------

  def _leaf(self, name):
    try:
      return self._leaves[name]
    except KeyError:
      raise KeyError(f"No tensor {name!r} in t5x checkpoint {self.path}") from None

  def _local_path(self, path: str) -> str:
    """A spec's (relative) array path, made absolute under the step dir."""
    path = path.rstrip("/")
    if os.path.isabs(path) and not os.path.exists(path):
      path = os.path.basename(path)  # written elsewhere, then moved here
    return os.path.join(self.directory, path)

  def _spec(self, name: str, leaf) -> dict:
    """A tensorstore spec opening `leaf`'s array with local file paths."""
    if _is_placeholder(leaf):
      rel = next(leaf[len(p):] for p in _PLACEHOLDER_PREFIXES if leaf.startswith(p))
      if self._ocdbt:  # zarr or zarr3 inside the database: `_open_store` tries both
        return {"kvstore": {"driver": "ocdbt", "base": f"file://{self.directory}/",
                            "path": rel}}
      path = os.path.join(self.directory, rel)
      return {"driver": self._zarr_driver(path), "kvstore": {"driver": "file", "path": path}}
    if not _is_ts_spec(leaf):
      raise CheckpointError(f"t5x tensor {name!r}: unsupported leaf {type(leaf).__name__} "
                            f"{str(leaf)[:80]!r}")
    spec = json.loads(json.dumps(leaf, default=_json_default))
    metadata = spec.get("metadata")
    if isinstance(metadata, dict):  # as t5x: tolerate other chunkings/compressors
      metadata.pop("chunks", None)
      metadata.pop("compressor", None)
    kvstore = spec.get("kvstore")
    if isinstance(kvstore, dict) and "path" in kvstore:
      if kvstore.get("driver") not in ("file", "gfile", "gcs"):
        raise CheckpointError(f"t5x tensor {name!r}: unsupported kvstore {kvstore}")
      spec["kvstore"] = {"driver": "file", "path": self._local_path(kvstore["path"])}
    elif "path" in spec:  # tensorstore < 0.1.14 layout
      spec["kvstore"] = {"driver": "file", "path": self._local_path(spec.pop("path"))}
    else:
      raise CheckpointError(f"t5x tensor {name!r}: tensorstore spec without a path: {leaf}")
    return spec

  @staticmethod
  def _zarr_driver(path: str) -> str:
    return "zarr3" if os.path.exists(os.path.join(path, "zarr.json")) else "zarr"

  def _zarr_metadata(self, name, leaf) -> dict | None:
    """Array metadata without tensorstore: the spec's, or `.zarray`."""
    if _is_ts_spec(leaf) and isinstance(leaf.get("metadata"), dict) \
        and "shape" in leaf["metadata"]:
      return leaf["metadata"]
    if _is_placeholder(leaf) or _is_ts_spec(leaf):
      spec = self._spec(name, leaf)
      if spec["kvstore"]["driver"] == "file":
        for meta in (".zarray", "zarr.json"):
          file = os.path.join(spec["kvstore"]["path"], meta)
          if os.path.isfile(file):
            with open(file) as f:
              return json.load(f)
    return None

  def _open_store(self, name, leaf):
    import tensorstore as ts  # pylint: disable=import-outside-toplevel
    spec = self._spec(name, leaf)
    drivers = [spec["driver"]] if "driver" in spec else ["zarr", "zarr3"]
    for driver in drivers:
      try:
        return ts.open({**spec, "driver": driver}, open=True, read=True).result()
      except Exception as e:  # pylint: disable=broad-except
        error = e  # tensorstore raises ValueError naming the path
    raise CheckpointError(f"Cannot open t5x tensor {name!r} ({spec}): {error}") from error

  def close(self):
    """Closes the checkpoint file; safe to call more than once."""
    buf, self._buf = getattr(self, "_buf", None), None
    if buf is not None:
      buf.close()
    f, self._file = getattr(self, "_file", None), None
    if f is not None:
      f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    self.close()


def _json_default(x):
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, (InlineArray, ChunkedArray, Span)):
    raise TypeError("array inside a tensorstore spec")
  raise TypeError(f"not JSON serializable: {type(x).__name__}")


def open_t5x_checkpoint(path) -> T5xCheckpointReader:
  """A `TensorReader` over the params of a t5x step directory (or its file).

  Opening parses only the msgpack structure; no tensor is read until `get`.
  Raises CheckpointError if `path` is not a t5x checkpoint.
  """
  return T5xCheckpointReader(path)


# ----------------------------------------------------------------------------
# Mapping onto dpjax's T5 params.
# ----------------------------------------------------------------------------


def _collapse_heads_in(x: np.ndarray) -> np.ndarray:
  """[embed, heads, kv] -> [embed, heads * kv]; 2-D passes through."""
  return x.reshape(x.shape[0], -1) if x.ndim == 3 else x


def _collapse_heads_out(x: np.ndarray) -> np.ndarray:
  """[heads, kv, embed] -> [heads * kv, embed]; 2-D passes through."""
  return x.reshape(-1, x.shape[-1]) if x.ndim == 3 else x


def _plan(config: T5Config):
  """Per dpjax param: (t5x name, [accepted checkpoint shapes], transform).

  Returned as a tree shaped like dpjax's params (as `abstract_params`).
  """
  expected, _ = abstract_params(config, input_length=1, target_length=1)
  h, dk, d = config.num_heads, config.d_kv, config.d_model

  def entry(path, leaf):
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    name = "/".join(keys)
    shapes = [tuple(leaf.shape)]
    transform = None
    if len(keys) >= 2 and keys[-1] == "kernel":
      if keys[-2] in _ATTENTION_IN:
        shapes.append((d, h, dk))
        transform = _collapse_heads_in
      elif keys[-2] == "out":
        shapes.append((h, dk, d))
        transform = _collapse_heads_out
    return name, shapes, transform

  return expected, jax.tree_util.tree_map_with_path(entry, expected)


def _is_plan_leaf(x) -> bool:
  return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str)


def param_sources(config: T5Config, reader: hf_common.TensorReader) -> PyTree:
  """dpjax T5 params as a tree of `hf_common.Source`s over a t5x reader.

  v1.0 (ReLU `mlp/wi`, tied embeddings) and v1.1 (`mlp/wi_0`, `mlp/wi_1`,
  `decoder/logits_dense`) follow from `config`. Attention kernels stored 3-D
  (`[embed, heads, kv]`, `[heads, kv, embed]`) are collapsed to dpjax's 2-D
  layout; 2-D ones are used as stored. Nothing is read here.
  """
  _, plan = _plan(config)
  return jax.tree.map(lambda p: hf_common.tensor(reader, p[0], p[2]), plan,
                      is_leaf=_is_plan_leaf)


def _check_fits(config: T5Config, reader, plan) -> None:
  """Missing/unused tensors and shape mismatches, from metadata only."""
  entries = jax.tree.leaves(plan, is_leaf=_is_plan_leaf)
  keys = set(reader.keys())
  wanted = {name for name, _, _ in entries}
  missing = sorted(wanted - keys)
  unused = sorted(keys - wanted)
  problems = []
  if missing:
    problems.append("missing from the checkpoint: " + ", ".join(
        f"{n} (expected shape {next(s[0] for m, s, _ in entries if m == n)})"
        for n in missing))
  if unused:
    problems.append("in the checkpoint but not in the model: " + ", ".join(
        f"{n} {reader.shape(n)}" for n in unused))
  for name, shapes, _ in entries:
    if name in keys:
      got = tuple(reader.shape(name))
      if got not in shapes:
        want = " or ".join(str(s) for s in shapes)
        problems.append(f"{name}: checkpoint shape {got}, model expects {want}")
  if problems:
    shown = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    raise CheckpointError(
        f"t5x checkpoint {getattr(reader, 'path', reader)} does not fit {config}:\n  "
        + "\n  ".join(shown) + more)


def load_t5x(path, config: T5Config, *, shardings=None) -> PyTree:
  """Loads the params of a t5x T5 checkpoint into dpjax's T5 layout.

  Every tensor's presence and shape is checked against `config` before any
  data is read (CheckpointError naming each missing, unused or misshapen
  tensor with both shapes). Then the params are built one leaf at a time and
  placed with `jax.device_put(x, sharding)`, so host memory holds one tensor.
  `shardings`: None (default device), one `jax.sharding.Sharding` for all
  leaves, or a tree of them shaped like the params (e.g.
  `partitioning.param_shardings(mesh, logical_axes)`). Optimizer state is
  ignored. Returns float32 params shaped like `abstract_params(config)`.
  """
  with open_t5x_checkpoint(path) as reader:
    expected, plan = _plan(config)
    _check_fits(config, reader, plan)
    sources = jax.tree.map(lambda p: hf_common.tensor(reader, p[0], p[2]), plan,
                           is_leaf=_is_plan_leaf)
    leaves, treedef = jax.tree.flatten(sources, is_leaf=lambda x: isinstance(x, hf_common.Source))
    expected_leaves = jax.tree.leaves(expected)
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
      sharding_leaves = [shardings] * len(leaves)
    else:
      sharding_leaves = treedef.flatten_up_to(shardings)
    out = []
    for src, want, sharding in zip(leaves, expected_leaves, sharding_leaves):
      x = src.load()
      if x.shape != tuple(want.shape):  # a transform bug, not a user error
        raise CheckpointError(f"{src.names[0]}: loaded shape {x.shape}, model expects "
                              f"{tuple(want.shape)}")
      arr = jax.device_put(x, sharding) if sharding is not None else jax.device_put(x)
      out.append(arr.block_until_ready())
      del x
    return jax.tree.unflatten(treedef, out)
