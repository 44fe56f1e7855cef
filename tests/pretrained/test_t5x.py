"""Tests of the t5x checkpoint import (`dpjax.pretrained.t5x`).

t5x cannot be installed here, so `write_t5x_checkpoint` below writes a
checkpoint the way t5x does, following google-research/t5x `t5x/checkpoints.py`
(`Checkpointer.save`, `_write_state_to_tensorstore`, `_get_parameter_infos`,
`_read_ts`, `load_t5x_checkpoint`; VERSION = 3; read at commits c2e488e4 and
01930ca9, 2022), `t5x/train_state.py` (state_dict layout, commit 11b09f9f),
`t5x/checkpoint_utils.py` (`detect_checkpoint_type`, commit 0ef4e965) and the
placeholder convention of the orbax-based `CheckpointManager` (google/orbax
`checkpoint/orbax/checkpoint/utils.py`, 'PLACEHOLDER://<name>'):

* `checkpoint_<step>/checkpoint` = `flax.serialization.msgpack_serialize` of
  `{'version': 3, 'optimizer': {'target': params, 'state': {'step',
  'param_states'}}}` (or the bare train state: a version-0 Flax checkpoint);
* arrays written with TensorStore (driver 'zarr', gzip compressor, dtype
  'bfloat16' for a bfloat16 array) in `checkpoint_<step>/target.encoder...`,
  their msgpack leaf the relative `ts.Spec(...).to_json()` (t5x
  `Checkpointer`) or 'PLACEHOLDER://name' (orbax); other arrays inline.

Deviations from t5x, deliberate: t5x writes to TensorStore exactly the arrays
that have partitioning axes; here a size threshold decides (so both kinds
occur). Chunks are smaller than t5x's 64 MiB so that reads span chunks.
Attention kernels are written 3-D as `t5x/examples/scalable_t5/layers.py`
stores them, or 2-D as `t5x/examples/t5/layers.py` (DenseGeneral reshapes a
2-D `(prod(in), prod(out))` param) does.
"""
from __future__ import annotations

import functools
import os

import flax.serialization
import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from dpjax.training import partitioning
from dpjax.models import t5
from dpjax.pretrained import t5x

ENC = np.array([[5, 6, 7, 8, 9, 10, 1, 0], [11, 12, 13, 1, 0, 0, 0, 0]], np.int32)
DEC = np.array([[0, 20, 21, 22, 23, 1], [0, 30, 31, 1, 0, 0]], np.int32)


def tiny_config(**overrides) -> t5.T5Config:
  fields = dict(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_heads=4,
                num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0)
  fields.update(overrides)
  return t5.T5Config(**fields)


V10 = tiny_config()
V11 = tiny_config(feed_forward="gated-gelu", tie_embeddings=False)


@functools.lru_cache(maxsize=None)
def _init(cfg: t5.T5Config, seed: int):
  params, axes = t5.init_params(cfg, jax.random.PRNGKey(seed), input_length=8, target_length=8)
  return jax.tree.map(np.asarray, params), axes


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, enc, dec):
  return t5.T5Transformer(cfg).apply({"params": params}, enc, dec)


# ----------------------------------------------------------------------------
# A t5x checkpoint writer (test helper).
# ----------------------------------------------------------------------------


def _flat(tree, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flat(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def _unflat(items):
  out = {}
  for path, v in items:
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def to_t5x_layout(cfg: t5.T5Config, params, kernels: str = "3d"):
  """dpjax params -> the t5x target tree (numpy), attention kernels 3-D or 2-D."""
  items = []
  for path, x in _flat(params):
    x = np.asarray(x)
    if kernels == "3d" and path[-1] == "kernel" and path[-2] in ("query", "key", "value"):
      x = x.reshape(cfg.d_model, cfg.num_heads, cfg.d_kv)
    elif kernels == "3d" and path[-1] == "kernel" and path[-2] == "out":
      x = x.reshape(cfg.num_heads, cfg.d_kv, cfg.d_model)
    items.append((path, x))
  return _unflat(items)


def _chunk_shape(shape, target_elements=256):
  """Divisors of each dim, shrinking the largest first (as t5x, smaller target)."""
  factors = [[i for i in range(1, n + 1) if n % i == 0] for n in shape]
  while np.prod([f[-1] for f in factors]) > target_elements:
    dim = max(range(len(shape)), key=lambda i: factors[i][-1])
    factors[dim].pop()
  return [f[-1] for f in factors]


def _write_tensorstore(step_dir: str, name: str, x: np.ndarray) -> dict:
  """Writes `x` as t5x does; returns the relative spec t5x puts in msgpack."""
  spec = {
      "driver": "zarr",
      "dtype": x.dtype.name,
      "kvstore": {"driver": "file", "path": name},
      "metadata": {"compressor": {"id": "gzip"}, "shape": list(x.shape),
                   "chunks": _chunk_shape(x.shape)},
  }
  absolute = {**spec, "kvstore": {"driver": "file", "path": os.path.join(step_dir, name)}}
  store = ts.open(absolute, create=True, open=True).result()
  store.write(x).result()
  return ts.Spec(spec).to_json()


def write_t5x_checkpoint(model_dir, target, *, step=1000, layout="optimizer", refs="spec",
                         bfloat16=(), inline_max_size=256, version=3):
  """Writes `target` (a t5x params tree) as `model_dir/checkpoint_<step>`.

  layout: 'optimizer' ({'version', 'optimizer': state}) or 'flax' (bare
  state, version 0). refs: 'spec' (ts.Spec dicts) or 'placeholder'.
  `bfloat16`: param names ('encoder/encoder_norm/scale') stored as bfloat16.
  Returns the step directory.
  """
  step_dir = os.path.join(os.fspath(model_dir), f"checkpoint_{step}")
  os.makedirs(step_dir)

  def leaf(name, x):
    if x.size <= inline_max_size:
      return x
    if refs == "placeholder":
      _write_tensorstore(step_dir, name, x)
      return f"PLACEHOLDER://{name}"
    return _write_tensorstore(step_dir, name, x)

  written_target = {}
  items = []
  for path, x in _flat(target):
    name = "/".join(path)
    if name in bfloat16:
      x = x.astype(ml_dtypes.bfloat16)
    items.append((path, leaf("target." + ".".join(path), x)))
  written_target = _unflat(items)
  # Adafactor-like factored second moments for a few params, also on disk.
  param_states = {}
  for path, x in list(_flat(target))[:6]:
    rows = np.full(x.shape[:1], 0.5, np.float32)
    cols = np.full(x.shape[1:2] or (1,), 0.25, np.float32)
    param_states[path] = {
        "v_row": leaf("state.param_states." + ".".join(path) + ".v_row", rows),
        "v_col": leaf("state.param_states." + ".".join(path) + ".v_col", cols),
        "v": np.zeros((1,), np.float32), "m": np.zeros((1,), np.float32)}
  state = {"target": written_target,
           "state": {"step": np.asarray(step, np.int32),
                     "param_states": _unflat(param_states.items())}}
  contents = {"version": version, "optimizer": state} if layout == "optimizer" else state
  with open(os.path.join(step_dir, "checkpoint"), "wb") as f:
    f.write(flax.serialization.msgpack_serialize(contents))
  return step_dir


def _bf16_round(x):
  return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)


def _assert_params_equal(loaded, expected):
  assert jax.tree.structure(loaded) == jax.tree.structure(expected)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(loaded), jax.tree.leaves(expected)):
    assert a.dtype == np.float32, path
    np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------


def test_v11_checkpointer_layout_3d_kernels_bfloat16(tmp_path):
  """t5x Checkpointer layout, ts.Spec leaves, 3-D kernels, two bf16 arrays."""
  params, _ = _init(V11, 0)
  bf16 = ("token_embedder/embedding",  # on disk (tensorstore bfloat16)
          "encoder/encoder_norm/scale")  # inline in the msgpack file
  step_dir = write_t5x_checkpoint(tmp_path, to_t5x_layout(V11, params, "3d"), bfloat16=bf16)
  assert os.path.isdir(os.path.join(step_dir, "target.encoder.layers_0.attention.query.kernel"))
  assert os.path.isdir(os.path.join(step_dir, "target.token_embedder.embedding"))

  loaded = t5x.load_t5x(step_dir, V11)

  expected = jax.tree.map(np.asarray, params)
  expected["token_embedder"]["embedding"] = _bf16_round(params["token_embedder"]["embedding"])
  expected["encoder"]["encoder_norm"]["scale"] = _bf16_round(
      params["encoder"]["encoder_norm"]["scale"])
  _assert_params_equal(loaded, expected)
  # bf16 rounding only: relative error below 2**-8.
  np.testing.assert_allclose(loaded["token_embedder"]["embedding"],
                             params["token_embedder"]["embedding"], rtol=2**-8)
  np.testing.assert_array_equal(_forward(V11, loaded, ENC, DEC), _forward(V11, expected, ENC, DEC))
  np.testing.assert_allclose(_forward(V11, loaded, ENC, DEC), _forward(V11, params, ENC, DEC),
                             atol=0.05)


def test_v10_flax_layout_2d_kernels_placeholders(tmp_path, monkeypatch):
  """Version-0 (bare train state) layout, orbax placeholders, 2-D kernels,
  flax's chunked form of inline arrays; logits equal the original's."""
  params, _ = _init(V10, 1)
  monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 256)  # chunk inline arrays
  step_dir = write_t5x_checkpoint(tmp_path, to_t5x_layout(V10, params, "2d"), layout="flax",
                                  refs="placeholder", inline_max_size=1024)
  monkeypatch.undo()
  with open(os.path.join(step_dir, "checkpoint"), "rb") as f:
    assert b"__msgpack_chunked_array__" in f.read()

  loaded = t5x.load_t5x(os.path.join(step_dir, "checkpoint"), V10)  # the file works too

  _assert_params_equal(loaded, params)
  np.testing.assert_array_equal(_forward(V10, loaded, ENC, DEC), _forward(V10, params, ENC, DEC))


def test_reader_names_shapes_from_metadata(tmp_path):
  params, _ = _init(V11, 0)
  step_dir = write_t5x_checkpoint(tmp_path, to_t5x_layout(V11, params, "3d"),
                                  bfloat16=("token_embedder/embedding",))
  kernel = "encoder/layers_0/attention/query/kernel"
  with t5x.open_t5x_checkpoint(step_dir) as reader:
    names = set(reader.keys())
    assert kernel in names and "decoder/logits_dense/kernel" in names
    assert not any("v_row" in n or "step" in n for n in names)  # optimizer state ignored
    assert len(names) == len(jax.tree.leaves(params))
    assert reader.dtype("token_embedder/embedding") == ml_dtypes.bfloat16
    assert reader.get("token_embedder/embedding").dtype == np.float32
    # Shapes come from metadata: delete the array data and ask again.
    import shutil
    shutil.rmtree(os.path.join(step_dir, "target." + kernel.replace("/", ".")))
    assert reader.shape(kernel) == (V11.d_model, V11.num_heads, V11.d_kv)
    assert reader.shape("encoder/encoder_norm/scale") == (V11.d_model,)  # inline
    with pytest.raises(t5x.CheckpointError, match="query"):
      reader.get(kernel)


def test_version2_uint16_bfloat16(tmp_path):
  """t5x VERSION 2 wrote bfloat16 arrays to TensorStore as uint16 bits."""
  x = np.linspace(-3, 3, 12 * 40, dtype=np.float32).reshape(12, 40)
  bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
  step_dir = write_t5x_checkpoint(tmp_path, {"w": bits}, version=2)
  with t5x.open_t5x_checkpoint(step_dir) as reader:
    np.testing.assert_array_equal(reader.get("w"), _bf16_round(x))


def test_orbax_ocdbt_placeholders(tmp_path):
  """Placeholders into an OCDBT database (orbax's later layout), zarr and zarr3."""
  step_dir = tmp_path / "checkpoint_5"
  step_dir.mkdir()
  x = np.arange(600, dtype=np.float32).reshape(20, 30)
  for driver, name in (("zarr", "target.a"), ("zarr3", "target.b")):
    store = ts.open({"driver": driver, "kvstore": {"driver": "ocdbt", "base": f"file://{step_dir}/",
                                                   "path": name}},
                    create=True, dtype="float32", shape=x.shape).result()
    store.write(x).result()
  contents = {"version": 3, "optimizer": {"target": {"a": "PLACEHOLDER://target.a",
                                                     "b": "PLACEHOLDER://target.b"}}}
  (step_dir / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(contents))
  with t5x.open_t5x_checkpoint(step_dir) as reader:
    assert sorted(reader.keys()) == ["a", "b"]
    for name in ("a", "b"):
      assert reader.shape(name) == (20, 30)
      np.testing.assert_array_equal(reader.get(name), x)


def test_wrong_shape_is_reported_before_any_read(tmp_path, monkeypatch):
  params, _ = _init(V11, 0)
  target = to_t5x_layout(V11, params, "3d")
  target["decoder"]["layers_1"]["mlp"]["wo"]["kernel"] = np.zeros((48, 32), np.float32)
  # Heads and kv swapped: collapses to the right 2-D shape, still wrong.
  target["encoder"]["layers_1"]["attention"]["key"]["kernel"] = np.zeros((32, 8, 4), np.float32)
  step_dir = write_t5x_checkpoint(tmp_path, target)

  def no_reads(self, name):
    raise AssertionError(f"read {name} before the shape check")
  monkeypatch.setattr(t5x.T5xCheckpointReader, "get", no_reads)
  with pytest.raises(t5x.CheckpointError) as err:
    t5x.load_t5x(step_dir, V11)
  msg = str(err.value)
  assert "decoder/layers_1/mlp/wo/kernel: checkpoint shape (48, 32), model expects (64, 32)" in msg
  assert "encoder/layers_1/attention/key/kernel: checkpoint shape (32, 8, 4)" in msg
  assert "(32, 32) or (32, 4, 8)" in msg
  assert isinstance(err.value, ValueError)


def test_missing_and_unused_params(tmp_path):
  params, _ = _init(V11, 0)
  target = to_t5x_layout(V11, params, "2d")
  del target["decoder"]["layers_0"]["pre_mlp_layer_norm"]
  step_dir = write_t5x_checkpoint(tmp_path, target)
  with pytest.raises(t5x.CheckpointError,
                     match=r"missing from the checkpoint: "
                     r"decoder/layers_0/pre_mlp_layer_norm/scale \(expected shape \(32,\)\)"):
    t5x.load_t5x(step_dir, V11)

  # A v1.1 checkpoint does not fit a v1.0 config: both directions are named.
  step_dir = write_t5x_checkpoint(tmp_path / "v11", to_t5x_layout(V11, params, "2d"))
  with pytest.raises(t5x.CheckpointError) as err:
    t5x.load_t5x(step_dir, V10)
  msg = str(err.value)
  assert "encoder/layers_0/mlp/wi/kernel (expected shape (32, 64))" in msg
  assert "decoder/logits_dense/kernel (32, 97)" in msg
  assert "encoder/layers_0/mlp/wi_0/kernel" in msg


def test_shardings(tmp_path):
  params, axes = _init(V10, 1)
  step_dir = write_t5x_checkpoint(tmp_path, to_t5x_layout(V10, params, "3d"))
  shardings = partitioning.param_shardings(partitioning.make_mesh(), axes)
  loaded = t5x.load_t5x(step_dir, V10, shardings=shardings)
  for a, s in zip(jax.tree.leaves(loaded), jax.tree.leaves(shardings)):
    assert a.sharding == s
  one = partitioning.replicated(partitioning.make_mesh())
  loaded = t5x.load_t5x(step_dir, V10, shardings=one)
  assert all(a.sharding == one for a in jax.tree.leaves(loaded))
  _assert_params_equal(loaded, params)


def test_param_sources_are_lazy(tmp_path):
  params, _ = _init(V11, 0)
  step_dir = write_t5x_checkpoint(tmp_path, to_t5x_layout(V11, params, "3d"))
  with t5x.open_t5x_checkpoint(step_dir) as reader:
    sources = t5x.param_sources(V11, reader)
    src = sources["decoder"]["layers_1"]["encoder_decoder_attention"]["out"]["kernel"]
    assert src.names == ("decoder/layers_1/encoder_decoder_attention/out/kernel",)
    np.testing.assert_array_equal(
        src.load(), params["decoder"]["layers_1"]["encoder_decoder_attention"]["out"]["kernel"])
    assert jax.tree.structure(sources) == jax.tree.structure(
        jax.tree.map(lambda _: t5x.hf_common.Source((), None), params))


def test_is_t5x_checkpoint(tmp_path):
  params, _ = _init(V10, 1)
  model_dir = tmp_path / "model"
  step_dir = write_t5x_checkpoint(model_dir, to_t5x_layout(V10, params, "3d"), step=7)
  flax_dir = write_t5x_checkpoint(tmp_path / "flax", {"w": np.ones(3, np.float32)},
                                  layout="flax")
  assert t5x.is_t5x_checkpoint(step_dir)
  assert t5x.is_t5x_checkpoint(os.path.join(step_dir, "checkpoint"))
  assert t5x.is_t5x_checkpoint(flax_dir)

  assert not t5x.is_t5x_checkpoint(model_dir)  # a model dir, not a step
  assert not t5x.is_t5x_checkpoint(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  assert not t5x.is_t5x_checkpoint(tmp_path / "empty")
  tf_dir = tmp_path / "tf"
  tf_dir.mkdir()
  (tf_dir / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-1000"\n')
  assert not t5x.is_t5x_checkpoint(tf_dir)
  other = tmp_path / "other"
  other.mkdir()
  (other / "checkpoint").write_bytes(flax.serialization.msgpack_serialize({"params": {}}))
  assert not t5x.is_t5x_checkpoint(other)
  (tmp_path / "file.bin").write_bytes(b"\x00\x01")
  assert not t5x.is_t5x_checkpoint(tmp_path / "file.bin")

  with pytest.raises(t5x.CheckpointError, match=r"steps \[7\].*checkpoint_7"):
    t5x.open_t5x_checkpoint(model_dir)
  with pytest.raises(t5x.CheckpointError, match="TensorFlow"):
    t5x.open_t5x_checkpoint(tf_dir)
  with pytest.raises(t5x.CheckpointError, match="no 'target'"):
    t5x.open_t5x_checkpoint(other)


def test_load_pretrained_dispatches_to_t5x(tmp_path):
  from dpjax.pretrained import load_pretrained  # pylint: disable=import-outside-toplevel
  params, _ = _init(V10, 1)
  step_dir = write_t5x_checkpoint(tmp_path, to_t5x_layout(V10, params, "3d"))
  _assert_params_equal(load_pretrained(step_dir, V10), params)
