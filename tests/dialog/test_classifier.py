"""The classifier policy's model: a tiny trained classifier against the
labels of held-out synthetic windows, and its saved directory."""
import json
import random

import numpy as np
import pytest

from dpjax.data.readers import multidogo
from dpjax.pipelines.dialog import classifier
from dpjax.models import bert
from dpjax.data.text.redaction import REDACTED as R

_AIR = ["flight", "seat", "boarding", "gate", "runway", "pilot", "luggage", "terminal"]
_INS = ["policy", "claim", "premium", "deductible", "adjuster", "coverage",
        "accident", "insurer"]
_FILLER = ["the", "my", "please", "i", "want", "to", "a", "and"]


def _synthetic(rng, domain_words, n):
  return [" ".join(rng.choice(domain_words if rng.random() < 0.5 else _FILLER)
                   for _ in range(rng.randint(4, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  rng = random.Random(0)
  train = {"AIR": _synthetic(rng, _AIR, 150), "INS": _synthetic(rng, _INS, 150)}
  config = bert.BertConfig(vocab_size=2000, max_position_embeddings=32, d_model=32,
                           num_layers=1, num_heads=2, d_ff=64, num_labels=2,
                           pooling="mean")
  model = classifier.train_classifier(
      train, config=config, vocab_path=multidogo.DEFAULT_BPE_VOCAB_PATH,
      merges_path=multidogo.DEFAULT_BPE_MERGES_PATH, max_tokens=32,
      batch_size=32, epochs=3, learning_rate=3e-3)
  path = str(tmp_path_factory.mktemp("clf"))
  model.save(path)
  held_out = {"AIR": _synthetic(rng, _AIR, 40), "INS": _synthetic(rng, _INS, 40)}
  return model, path, held_out


def test_trained_classifier_separates_domains(trained):
  model, _, held_out = trained
  assert model.labels == ("AIR", "INS")
  windows, labels = classifier.training_windows(held_out)
  probs = model.probabilities(windows)
  assert probs.shape == (80, 2)
  np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
  assert np.mean(probs.argmax(1) == labels) > 0.9  # chance is 0.5


def test_saved_classifier_policy(trained):
  model, path, held_out = trained
  loaded = classifier.DomainClassifier.load(path)
  texts = held_out["AIR"][:5] + held_out["INS"][:5]
  np.testing.assert_allclose(loaded.probabilities(texts), model.probabilities(texts),
                             atol=1e-6)
  policy = classifier.classifier_policy(path, threshold=0.5)
  assert policy.domains == ("AIR", "INS") and policy.stride == 8
  text = "please check my flight and boarding gate at the terminal"
  assert policy.flags(text, ["AIR"]) and not policy.flags(text, ["INS"])
  assert policy.redact(text, ["AIR"]) == " ".join([R] * len(text.split()))


def test_load_errors(trained, tmp_path):
  _, path, _ = trained
  with pytest.raises(FileNotFoundError, match="lacks"):
    classifier.DomainClassifier.load(str(tmp_path))
  meta = json.loads(open(f"{path}/config.json").read())
  meta["bert_config"]["d_model"] = 64
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in ("params.msgpack", "vocab.json", "merges.txt"):
    (bad / name).write_bytes(open(f"{path}/{name}", "rb").read())
  (bad / "config.json").write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="does not match"):
    classifier.DomainClassifier.load(str(bad))
