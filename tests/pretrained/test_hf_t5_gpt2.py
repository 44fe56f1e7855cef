"""Hugging Face checkpoints of T5 (v1.0, v1.1) and GPT-2 <-> dpjax.

Randomly initialised `transformers` PyTorch models (no downloads) are saved as
checkpoints (safetensors, sharded safetensors, PyTorch .bin), loaded into
dpjax, and their logits compared with PyTorch's on the same tokens; exports
are loaded back by transformers and by `load_hf`.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import types  # noqa: E402
import weakref  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from dpjax.training import partitioning  # noqa: E402
from dpjax.models import gpt2, t5  # noqa: E402
from dpjax.pretrained import hf  # noqa: E402
import dpjax.pretrained as pretrained  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

VOCAB = 101
ATOL = 1e-4  # float32, as the issue asks


# ----------------------------------------------------------------------------
# Models: a transformers model with random weights and the matching dpjax config.
# ----------------------------------------------------------------------------


def _randomize(model, weight_std=None):
  """HF initialises norms to 1 and biases to 0; random ones test the mapping.

  GPT-2's initializer (std 0.02) gives near-uniform attention and tiny
  logits at this size, so its weights are scaled up (`weight_std`).
  """
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or "ln_" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.1 * torch.randn_like(p))
      elif weight_std is not None:
        p.copy_(weight_std * torch.randn_like(p))


def t5_pair(v11: bool):
  torch.manual_seed(1 if v11 else 0)
  ours = t5.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48 if v11 else 64,
                     num_heads=4, num_encoder_layers=2, num_decoder_layers=3,
                     feed_forward="gated-gelu" if v11 else "relu", tie_embeddings=not v11)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(
      vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=ours.d_ff, num_heads=4, num_layers=2,
      num_decoder_layers=3, dropout_rate=0.0, feed_forward_proj=ours.feed_forward,
      tie_word_embeddings=not v11))
  if v11:  # transformers 5 ties lm_head even for T5.1.1; real v1.1 checkpoints do not
    model.lm_head.weight = torch.nn.Parameter(0.2 * torch.randn(VOCAB, 32))
  _randomize(model)
  return model.eval(), ours


def gpt2_pair():
  torch.manual_seed(2)
  ours = gpt2.GPT2Config(vocab_size=VOCAB, n_positions=40, d_model=32, num_layers=2,
                         num_heads=4)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=VOCAB, n_positions=40, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
  _randomize(model, weight_std=0.2)
  return model.eval(), ours


MODELS = {"t5_v10": lambda: t5_pair(False), "t5_v11": lambda: t5_pair(True),
          "gpt2": gpt2_pair}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
  """(name, torch model, dpjax config)."""
  return (request.param, *MODELS[request.param]())


def save(model, directory, fmt: str) -> pathlib.Path:
  """A checkpoint directory in one of the formats load_hf reads."""
  directory = pathlib.Path(directory)
  if fmt == "sharded":
    model.save_pretrained(directory, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
  else:
    model.save_pretrained(directory)
  if fmt == "bin":  # transformers 5 writes only safetensors; older checkpoints are .bin
    (directory / "model.safetensors").unlink()
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
  return directory


# ----------------------------------------------------------------------------
# Logits on the same tokens.
# ----------------------------------------------------------------------------

RNG = np.random.default_rng(0)
ENC = RNG.integers(2, VOCAB, (2, 12)).astype(np.int32)
ENC[1, 7:] = 0  # padding
DEC = RNG.integers(2, VOCAB, (2, 9)).astype(np.int32)
DEC[:, 0] = 0  # decoder start
TOKENS = RNG.integers(0, VOCAB, (2, 20)).astype(np.int32)
MASK = np.ones_like(TOKENS)
MASK[1, 13:] = 0  # right padding


def dpjax_logits(cfg, params) -> np.ndarray:
  if isinstance(cfg, t5.T5Config):
    fn = jax.jit(lambda p: t5.T5Transformer(cfg).apply({"params": p}, ENC, DEC))
  else:
    fn = jax.jit(lambda p: gpt2.GPT2(cfg).apply({"params": p}, TOKENS, attention_mask=MASK))
  return np.asarray(fn(params))


def torch_logits(model) -> np.ndarray:
  with torch.no_grad():
    if isinstance(model, transformers.T5ForConditionalGeneration):
      out = model(input_ids=torch.tensor(ENC, dtype=torch.long),
                  attention_mask=torch.tensor(ENC > 0, dtype=torch.long),
                  decoder_input_ids=torch.tensor(DEC, dtype=torch.long))
    else:
      out = model(input_ids=torch.tensor(TOKENS, dtype=torch.long),
                  attention_mask=torch.tensor(MASK, dtype=torch.long))
  return out.logits.float().numpy()


def max_diff(ours, theirs) -> float:
  return float(np.max(np.abs(ours - theirs)))


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


DIFFS = {}  # (model, format) -> max abs logit difference, printed at the end


@pytest.fixture(scope="module", autouse=True)
def report_diffs():
  yield
  if DIFFS:
    print("\nmax |logits dpjax - torch|:", json.dumps(DIFFS, indent=1))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_logits_match_torch(pair, fmt, tmp_path):
  name, model, cfg = pair
  params = hf.load_hf(save(model, tmp_path, fmt), cfg)
  assert jax.tree.structure(params) == jax.tree.structure(_abstract(cfg))
  diff = max_diff(dpjax_logits(cfg, params), torch_logits(model))
  DIFFS[f"{name}/{fmt}"] = diff
  assert diff < ATOL


def test_sharded_checkpoint(tmp_path):
  model, cfg = t5_pair(True)
  directory = save(model, tmp_path, "sharded")
  assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
  params = hf.load_hf(directory, cfg)
  diff = max_diff(dpjax_logits(cfg, params), torch_logits(model))
  DIFFS["t5_v11/sharded"] = diff
  assert diff < ATOL


def _abstract(cfg):
  if isinstance(cfg, t5.T5Config):
    return t5.abstract_params(cfg, input_length=1, target_length=1)[0]
  return gpt2.abstract_params(cfg, max_length=1)[0]


def test_export_loads_in_transformers_and_round_trips(pair, tmp_path):
  name, model, cfg = pair
  params = hf.load_hf(save(model, tmp_path / "in", "safetensors"), cfg)
  hf.export_hf(params, cfg, tmp_path / "out")
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
  cls = type(model)
  theirs = cls.from_pretrained(tmp_path / "out").eval()
  ours = dpjax_logits(cfg, params)
  diff = max_diff(ours, torch_logits(theirs))
  DIFFS[f"{name}/export->transformers"] = diff
  assert diff < ATOL
  assert_trees_equal(hf.load_hf(tmp_path / "out", cfg), params)
  # The export holds exactly the original's (non-alias) tensors.
  original = {k: v.float().numpy() for k, v in model.state_dict().items()}
  for k, v in load_file(tmp_path / "out" / "model.safetensors").items():
    np.testing.assert_array_equal(v, original[k], err_msg=k)


def test_export_of_fresh_params_round_trips(tmp_path):
  cfg = t5.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_heads=2,
                    num_encoder_layers=1, num_decoder_layers=2, feed_forward="gated-gelu",
                    tie_embeddings=False)
  params, _ = t5.init_params(cfg, jax.random.key(0), input_length=4, target_length=4)
  hf.export_hf(params, cfg, tmp_path)
  assert_trees_equal(hf.load_hf(tmp_path, cfg), params)
  bad = jax.tree.map(lambda x: x, params)
  bad["token_embedder"]["embedding"] = params["token_embedder"]["embedding"][:-1]
  with pytest.raises(hf.CheckpointError, match=r"param token_embedder/embedding: shape "
                     r"\(100, 16\), expected \(101, 16\)"):
    hf.export_hf(bad, cfg, tmp_path / "bad")
  assert not (tmp_path / "bad").exists()


def test_scanned_layers_export_unrolled_and_load_stacked(tmp_path):
  """A `scan_layers` T5 writes the checkpoint the unrolled model writes, and
  reads it back stacked, placed by the stacked params' shardings."""
  cfg = t5.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_heads=2,
                    num_encoder_layers=2, num_decoder_layers=3)
  scanned = dataclasses.replace(cfg, scan_layers=True)
  params, _ = t5.init_params(cfg, jax.random.key(0), input_length=4, target_length=4)
  stacked = t5.scan_params(params)
  hf.export_hf(stacked, scanned, tmp_path / "scanned")
  hf.export_hf(params, cfg, tmp_path / "unrolled")
  assert (load_file(tmp_path / "scanned" / "model.safetensors").keys()
          == load_file(tmp_path / "unrolled" / "model.safetensors").keys())
  assert_trees_equal(hf.load_hf(tmp_path / "scanned", cfg), params)
  mesh = partitioning.make_mesh({"fsdp": -1})
  axes = t5.abstract_params(scanned, input_length=1, target_length=1)[1]
  shardings = partitioning.param_shardings(
      mesh, axes, partitioning.logical_axis_rules("fsdp"), shapes=stacked)
  loaded = pretrained.load_pretrained(tmp_path / "scanned", scanned,
                                      shardings=shardings)
  assert_trees_equal(loaded, stacked)
  assert (loaded["decoder"]["layers"]["mlp"]["wi"]["kernel"].sharding
          == shardings["decoder"]["layers"]["mlp"]["wi"]["kernel"])


def test_bfloat16_and_float16_checkpoints_upcast(tmp_path):
  model, cfg = gpt2_pair()
  sd = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
  half = model.to(torch.bfloat16)  # in place
  directory = save(half, tmp_path / "bf16", "safetensors")
  expected = {k: v.float().numpy() for k, v in half.state_dict().items()}
  params = hf.load_hf(directory, cfg)
  np.testing.assert_array_equal(params["token_embedder"]["embedding"],
                                expected["transformer.wte.weight"])
  assert params["token_embedder"]["embedding"].dtype == np.float32
  directory = save(model, tmp_path / "f16", "safetensors")
  (directory / "model.safetensors").unlink()
  torch.save(sd, directory / "pytorch_model.bin")
  params = hf.load_hf(directory, cfg)
  np.testing.assert_array_equal(params["layers_1"]["mlp"]["wo"]["kernel"],
                                sd["transformer.h.1.mlp.c_proj.weight"].float().numpy())


# ----------------------------------------------------------------------------
# Errors: named tensors and fields, both shapes or values, nothing read.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
  model, cfg = t5_pair(False)
  return save(model, tmp_path_factory.mktemp("t5"), "safetensors"), cfg


def _edited(t5_dir, tmp_path, edit_tensors=None, edit_config=None):
  src, _ = t5_dir
  directory = pathlib.Path(shutil.copytree(src, tmp_path / "ckpt"))
  if edit_tensors:
    tensors = load_file(directory / "model.safetensors")
    edit_tensors(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  if edit_config:
    config = json.loads((directory / "config.json").read_text())
    edit_config(config)
    (directory / "config.json").write_text(json.dumps(config))
  return directory


class CountingReader:
  """Records how many loaded arrays are alive at once, and how many reads."""

  def __init__(self, reader):
    self.reader, self.live, self.peak, self.reads = reader, 0, 0, 0

  def keys(self):
    return self.reader.keys()

  def shape(self, name):
    return self.reader.shape(name)

  def _dead(self):
    self.live -= 1

  def get(self, name):
    x = self.reader.get(name)
    self.reads += 1
    self.live += 1
    self.peak = max(self.peak, self.live)
    owner = x  # views share their memory owner's lifetime, not x's
    while isinstance(owner.base, np.ndarray):
      owner = owner.base
    weakref.finalize(owner, self._dead)
    return x


def _load_counting(directory, cfg, **kwargs):
  hf_config, reader = hf.open_hf_checkpoint(directory)
  counting = CountingReader(reader)
  try:
    return hf.load_from_reader(hf_config, counting, cfg, **kwargs), counting
  except hf.CheckpointError:
    assert counting.reads == 0, "tensors were read before the checks failed"
    raise


W = "encoder.block.1.layer.1.DenseReluDense.wi.weight"


def test_wrong_shape_names_tensor_and_both_shapes(t5_dir, tmp_path):
  def edit(tensors):
    tensors[W] = tensors[W][:60]
  directory = _edited(t5_dir, tmp_path, edit_tensors=edit)
  with pytest.raises(hf.CheckpointError) as e:
    _load_counting(directory, t5_dir[1])
  msg = str(e.value)
  assert (f"tensor '{W}' of shape (60, 32) gives (32, 60), but param "
          "encoder/layers_1/mlp/wi/kernel has shape (32, 64)") in msg


def test_wrong_shape_of_fused_gpt2_attention(tmp_path):
  model, cfg = gpt2_pair()
  directory = save(model, tmp_path, "safetensors")
  tensors = load_file(directory / "model.safetensors")
  name = "transformer.h.1.attn.c_attn.weight"
  tensors[name] = tensors[name][:, 1:]
  save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=rf"tensor '{name}' of shape \(32, 95\) does not "
                     r"fit param layers_1/attention/query/kernel \(shape \(32, 32\)\): its "
                     r"fused query/key/value axis is 95, not 3 \* 32"):
    _load_counting(directory, cfg)


def test_missing_tensor(t5_dir, tmp_path):
  directory = _edited(t5_dir, tmp_path,
                      edit_tensors=lambda t: t.pop("decoder.final_layer_norm.weight"))
  with pytest.raises(hf.CheckpointError, match=r"missing tensor 'decoder.final_layer_norm"
                     r".weight', needed for param decoder/decoder_norm/scale \(shape \(32,\)\)"):
    _load_counting(directory, t5_dir[1])


def test_extra_tensor(t5_dir, tmp_path):
  def edit(tensors):
    tensors["encoder.block.0.layer.0.SelfAttention.extra"] = np.zeros((3, 2), np.float32)
  directory = _edited(t5_dir, tmp_path, edit_tensors=edit)
  with pytest.raises(hf.CheckpointError, match=r"unused tensor 'encoder.block.0.layer.0."
                     r"SelfAttention.extra' of shape \(3, 2\)"):
    _load_counting(directory, t5_dir[1])


def test_config_disagreement_names_field_and_both_values(t5_dir, tmp_path):
  def edit(config):
    config["d_ff"] = 100
    config["num_layers"] = 3
    config["dropout_rate"] = 0.3  # a fine-tuning choice: may differ
  directory = _edited(t5_dir, tmp_path, edit_config=edit)
  with pytest.raises(hf.CheckpointError) as e:
    _load_counting(directory, t5_dir[1])
  msg = str(e.value)
  assert "d_ff: checkpoint 100, gin 64" in msg
  assert "num_encoder_layers (config.json 'num_layers'): checkpoint 3, gin 2" in msg
  assert "dropout" not in msg
  # Only dropout differs: fine.
  directory = _edited(t5_dir, tmp_path / "2", edit_config=lambda c: c.update(dropout_rate=0.3))
  hf.load_hf(directory, t5_dir[1])


def test_other_model_and_unsupported_config(t5_dir, tmp_path):
  with pytest.raises(hf.CheckpointError, match=r"model_type is 't5', but the gin model "
                     r"GPT2Config reads \('gpt2',\)"):
    hf.load_hf(t5_dir[0], gpt2_pair()[1])
  directory = _edited(t5_dir, tmp_path,
                      edit_config=lambda c: c.update(feed_forward_proj="gated-silu"))
  with pytest.raises(hf.CheckpointError, match="feed_forward_proj 'gated-silu'"):
    hf.load_hf(directory, t5_dir[1])
  (directory / "model.safetensors").unlink()
  with pytest.raises(hf.CheckpointError, match="no weights"):
    hf.load_hf(directory, t5_dir[1])


# ----------------------------------------------------------------------------
# Memory, shardings, dispatch, tokenizer files.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_loads_one_tensor_at_a_time(t5_dir, fmt, tmp_path, monkeypatch):
  """At most one loaded host array is alive at any time.

  `_put` is wrapped to copy its input, as a host -> accelerator transfer does
  (on CPU jax may adopt the buffer instead, which is no second copy either);
  so an array the loader kept would stay alive and be counted.
  """
  put = hf._put
  monkeypatch.setattr(hf, "_put", lambda x, sharding: put(np.array(x, copy=True), sharding))
  directory, cfg = t5_dir
  if fmt == "bin":
    directory = _edited(t5_dir, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()},
               directory / "pytorch_model.bin")
  params, counting = _load_counting(directory, cfg)
  n_params = len(jax.tree.leaves(params))
  assert counting.reads == n_params  # every tensor read once, none twice
  assert counting.peak == 1
  assert counting.live == 0


def test_shardings(t5_dir):
  directory, cfg = t5_dir
  mesh = partitioning.make_mesh()
  _, axes = t5.abstract_params(cfg, input_length=1, target_length=1)
  shardings = partitioning.param_shardings(mesh, axes)
  params = hf.load_hf(directory, cfg, shardings=shardings)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert x.sharding == s
  params = hf.load_hf(directory, cfg, shardings=partitioning.replicated(mesh))
  assert all(x.sharding == partitioning.replicated(mesh) for x in jax.tree.leaves(params))


def test_load_pretrained_dispatch(t5_dir, tmp_path, monkeypatch):
  directory, cfg = t5_dir
  assert_trees_equal(pretrained.load_pretrained(directory, cfg), hf.load_hf(directory, cfg))
  with pytest.raises(pretrained.CheckpointError,
                     match="neither a Hugging Face directory .config.json. nor a t5x checkpoint"):
    pretrained.load_pretrained(tmp_path, cfg)
  calls = []
  fake = types.SimpleNamespace(
      is_t5x_checkpoint=lambda path: pathlib.Path(path).name == "t5x_ckpt",
      load_t5x=lambda path, config, *, shardings=None: calls.append(path) or "t5x params")
  monkeypatch.setattr(pretrained, "t5x", fake)
  assert pretrained.load_pretrained(tmp_path / "t5x_ckpt", cfg) == "t5x params"
  assert calls == [tmp_path / "t5x_ckpt"]
  with pytest.raises(pretrained.CheckpointError, match="neither"):
    pretrained.load_pretrained(tmp_path, cfg)


def test_tokenizer_files(tmp_path):
  assert pretrained.tokenizer_files(tmp_path) == {}
  (tmp_path / "vocab.txt").write_text("")
  assert pretrained.tokenizer_files(tmp_path) == {"wordpiece": str(tmp_path / "vocab.txt")}
  (tmp_path / "vocab.json").write_text("{}")
  (tmp_path / "merges.txt").write_text("")
  assert pretrained.tokenizer_files(tmp_path) == {
      "vocab": str(tmp_path / "vocab.json"), "merges": str(tmp_path / "merges.txt")}
  (tmp_path / "spiece.model").write_bytes(b"")
  assert pretrained.tokenizer_files(tmp_path) == {"sentencepiece": str(tmp_path / "spiece.model")}
