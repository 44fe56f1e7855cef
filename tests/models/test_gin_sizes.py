"""The gin model sizes build the intended architectures (shapes only)."""
import pathlib

import gin
import pytest

from dpjax import configurables
from dpjax.models import t5

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin" / "models"

# Exact parameter counts of the Hugging Face checkpoints (t5-small, t5-base,
# t5-large, t5-3b, google/t5-v1_1-{small,base,large,xl}).
EXPECTED = {
    "t5_small": 60_506_624,
    "t5_base": 222_903_552,
    "t5_large": 737_668_096,
    "t5_xl": 2_851_598_336,
    "t5_1_1_small": 76_961_152,
    "t5_1_1_base": 247_577_856,
    "t5_1_1_large": 783_150_080,
    "t5_1_1_xl": 2_849_757_184,
}


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _config(name, bindings=()):
  gin.parse_config_files_and_bindings([str(GIN_DIR / f"{name}.gin")], list(bindings))
  return configurables.T5Config()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_param_count(name):
  cfg = _config(name)
  assert cfg.vocab_size == 32128
  assert (cfg.feed_forward == "gated-gelu") == name.startswith("t5_1_1")
  assert cfg.tie_embeddings == (not name.startswith("t5_1_1"))
  shapes, _ = t5.abstract_params(cfg, input_length=4, target_length=4)
  assert t5.param_count(shapes) == EXPECTED[name]


def test_tiny_leaves_vocab_to_task():
  cfg = _config("t5_tiny", ["T5Config.vocab_size = 1000"])
  assert (cfg.vocab_size, cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.num_heads) == (1000, 64, 16,
                                                                             128, 4)
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (2, 2)
  assert cfg.feed_forward == "relu" and cfg.tie_embeddings
  assert "vocab_size" not in (GIN_DIR / "t5_tiny.gin").read_text()


def test_every_gin_file_is_tested():
  assert {p.stem for p in GIN_DIR.glob("t5*.gin")} == set(EXPECTED) | {"t5_tiny"}
