"""`--adapters_only` releases as a PEFT user loads them: random tiny
transformers models (no downloads) as the base, dpjax LoRA adapters on it,
the release written by `dpjax.export`'s adapters path, then
`PeftModel.from_pretrained(base, release)` gives dpjax's logits; the release
names its base portably and fingerprints it; a grown GPT-2 vocabulary is
carried as PEFT carries resized embeddings; `load_pretrained` reads it back."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub

import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft_lib = pytest.importorskip("peft")

from dpjax import errors, export, pretrained  # noqa: E402
from dpjax.models import gpt2, lora  # noqa: E402
from dpjax.pretrained import peft  # noqa: E402
from tests.models.test_lora import with_random_b  # noqa: E402
from tests.pretrained.test_hf_t5_gpt2 import (ATOL, MASK, TOKENS, VOCAB,  # noqa: E402
                                              dpjax_logits, gpt2_pair, t5_pair,
                                              torch_logits)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

LORA = lora.LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "mlp"))
GROWN = VOCAB + 5
PAIRS = {"t5": lambda: t5_pair(False), "gpt2": gpt2_pair}


def _release(name, tmp_path, vocab_size=None):
  """(torch base class, dpjax config with LoRA, trained-like params, base
  directory, release directory)."""
  model, cfg = PAIRS[name]()
  base_dir = tmp_path / "base"
  model.save_pretrained(base_dir)
  cfg = dataclasses.replace(cfg, lora=LORA, **(
      {"vocab_size": vocab_size} if vocab_size else {}))
  params = with_random_b(pretrained.load_pretrained(
      base_dir, cfg, rng=jax.random.PRNGKey(0)))
  out = tmp_path / "release"
  out.mkdir()
  files = export.write_params(params, cfg, str(out), adapters_only=True,
                              base=export.adapter_base(cfg, str(base_dir)))
  assert sorted(files) == sorted(os.listdir(out)) == [
      "adapter_config.json", "adapter_model.safetensors", "base_model.json"]
  return type(model), cfg, params, base_dir, out


def _no_local_path(out, tmp_path):
  for f in ("adapter_config.json", "base_model.json"):
    text = (out / f).read_text()
    assert str(tmp_path) not in text and '"/' not in text, f


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_peft_loads_the_release_onto_its_base_as_dpjax_computes(name,
                                                               tmp_path):
  cls, cfg, params, base_dir, out = _release(name, tmp_path)
  config = json.loads((out / "adapter_config.json").read_text())
  record = json.loads((out / "base_model.json").read_text())
  assert config["base_model_name_or_path"] == "base"
  assert record["base_model_name_or_path"] == "base"
  assert list(record["weights_sha256"]) == ["model.safetensors"]
  assert record["embeddings_carried"] == []
  _no_local_path(out, tmp_path)

  theirs = peft_lib.PeftModel.from_pretrained(
      cls.from_pretrained(base_dir), out).eval()
  ours = dpjax_logits(cfg, params)
  assert isinstance(theirs, peft_lib.PeftModel)
  assert np.max(np.abs(ours - torch_logits(theirs.get_base_model()))) < ATOL
  base_only = dpjax_logits(dataclasses.replace(cfg, lora=None),
                           lora.split(params)[0])
  assert np.max(np.abs(ours - base_only)) > 100 * ATOL  # the adapters count

  loaded = pretrained.load_pretrained(out, cfg, base_path=base_dir)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_a_grown_vocabulary_is_carried_and_reproduced_through_peft(tmp_path):
  cls, cfg, params, base_dir, out = _release("gpt2", tmp_path, GROWN)
  record = json.loads((out / "base_model.json").read_text())
  assert (record["base_vocab_size"], record["vocab_size"]) == (VOCAB, GROWN)
  assert record["embeddings_carried"] == ["lm_head.weight",
                                          "transformer.wte.weight"]
  _no_local_path(out, tmp_path)

  base = cls.from_pretrained(base_dir)
  base.resize_token_embeddings(GROWN)  # PEFT's way for resized embeddings
  theirs = peft_lib.PeftModel.from_pretrained(base, out).eval()
  tokens = TOKENS.copy()
  tokens[:, 3:6] = [VOCAB, VOCAB + 2, GROWN - 1]  # appended tokens
  want = np.asarray(jax.jit(lambda p: gpt2.GPT2(cfg).apply(
      {"params": p}, tokens, attention_mask=MASK))(params))
  with torch.no_grad():
    got = theirs(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(MASK, dtype=torch.long)
                 ).logits.float().numpy()
  assert got.shape[-1] == GROWN
  assert np.max(np.abs(want - got)) < ATOL

  loaded = pretrained.load_pretrained(out, cfg, base_path=base_dir)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_the_base_is_named_portably_and_checked_by_its_fingerprint(tmp_path):
  cls, cfg, params, base_dir, out = _release("gpt2", tmp_path)
  # The release alone: the base it names is not here; one line says which.
  with pytest.raises(pretrained.CheckpointError) as e:
    pretrained.load_pretrained(out, cfg)
  assert "'base'" in str(e.value) and "sha256" in str(e.value)
  assert "\n" not in str(e.value)
  # Another base of the same shapes is refused by its fingerprint.
  other = tmp_path / "other"
  shutil.copytree(base_dir, other)
  from safetensors.numpy import load_file, save_file
  weights = load_file(str(base_dir / "model.safetensors"))
  weights["transformer.ln_f.weight"] = weights["transformer.ln_f.weight"] + 1
  save_file(weights, str(other / "model.safetensors"),
            metadata={"format": "pt"})
  with pytest.raises(pretrained.CheckpointError, match="is not the base"):
    pretrained.load_pretrained(out, cfg, base_path=other)

  # A hub name in config.json is the name; a local one is not; --base_model
  # overrides; a local path is never written.
  hf_config = json.loads((base_dir / "config.json").read_text())
  for hub, want in (("openai-community/gpt2", "openai-community/gpt2"),
                    (str(tmp_path / "x" / "gpt2"), "base"),
                    ("./gpt2", "base")):
    (base_dir / "config.json").write_text(
        json.dumps({**hf_config, "_name_or_path": hub}))
    assert export.adapter_base(cfg, str(base_dir))[
        "base_model_name_or_path"] == want
  assert export.adapter_base(cfg, str(base_dir), "my-gpt2")[
      "base_model_name_or_path"] == "my-gpt2"
  with pytest.raises(errors.UsageError, match="local path"):
    export.adapter_base(cfg, str(base_dir), str(base_dir))
  with pytest.raises(errors.UsageError, match="no INITIAL_CHECKPOINT_PATH"):
    export.adapter_base(cfg, None)
  with pytest.raises(errors.UsageError, match="adapter release"):
    export.adapter_base(cfg, str(out))
  with pytest.raises(pretrained.CheckpointError, match="local path"):
    peft.export_adapters(params, cfg, tmp_path / "r2",
                         base_model=str(base_dir))
