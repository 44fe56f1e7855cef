"""The downstream classifier (dpjax.pipelines.text_classifier) learns a trivially
separable labelling and is scored on held-out texts."""
import numpy as np
import tokenizers

from dpjax.pipelines import text_classifier as classifier
from dpjax.data.readers import textcls
from dpjax.models import bert

MARKERS = ("splendid", "dreadful")  # the class of a text is its marker word
FILLER = ("the", "film", "cast", "plot", "is", "a", "and", "story", "of", "ending", "quite")


def _texts(rng, n):
  labels = rng.integers(0, 2, n)
  texts = []
  for y in labels:
    words = list(rng.choice(FILLER, rng.integers(3, 9)))
    words.insert(rng.integers(0, len(words) + 1), MARKERS[y])
    texts.append(" ".join(words))
  return texts, labels


def test_classifier_learns_a_separable_set():
  tokenizer = tokenizers.ByteLevelBPETokenizer(textcls.DEFAULT_BPE_VOCAB_PATH,
                                               textcls.DEFAULT_BPE_MERGES_PATH)
  rng = np.random.default_rng(0)
  train, test = _texts(rng, 96), _texts(rng, 64)
  config = bert.BertConfig(vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=16,
                           d_model=32, num_layers=1, num_heads=2, d_ff=64, dropout_rate=0.0,
                           num_labels=2, pooling="mean")
  model = classifier.train_classifier(*train, config=config, tokenizer=tokenizer, max_tokens=16,
                                      batch_size=32, epochs=8, learning_rate=3e-3)
  assert model.accuracy(*test) > 0.9
  probs = model.probabilities(test[0][:3])
  assert probs.shape == (3, 2) and np.allclose(probs.sum(1), 1, atol=1e-5)
