"""SeqPATE data: AirDialogue / Europarl readers and sentence-completion
examples against hand-written files, the committed sample against a fresh
generation, and pseudo-data against an explicit greedy decoding loop."""
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer

from dpjax.data.readers import seqpate
from dpjax.models import gpt2
from dpjax.pipelines.seqpate import pseudo_data
from tasks import seqpate as seqpate_tasks
from tasks.seqpate_sample import generate


def _dialogue(name, turns, **extra):
  return json.dumps({"intent": {"name": name, "goal": "book"},
                     "action": {"status": "book", "name": name, "flight": []},
                     "correct_sample": True, "dialogue": turns, **extra})


def test_read_airdialogue(tmp_path):
  path = tmp_path / "train_data.json"
  path.write_text(
      _dialogue("Janet Miller", ["customer: Hi.", "agent:  Hello, how can I "
                                 "help?", "customer: I am Janet Miller."])
      + "\n\n" + _dialogue("Bo Li", ["agent: Welcome.", "customer:"]) + "\n")
  got = list(seqpate.read_airdialogue(str(path)))
  assert [(s.text, s.user_id) for s in got] == [
      ("Hi.", "Janet Miller"), ("Hello, how can I help?", "Janet Miller"),
      ("I am Janet Miller.", "Janet Miller"), ("Welcome.", "Bo Li")]
  assert got[2].where == f"{path}:1:2" and got[3].where == f"{path}:3:0"


@pytest.mark.parametrize("line,reason", [
    ("{not json", "not valid JSON"),
    (json.dumps({"dialogue": ["customer: hi"]}), "intent.name"),
    (_dialogue("A B", "customer: hi"), "'dialogue'"),
    (_dialogue("A B", ["pilot: hi"]), "dialogue\\[0\\] does not start"),
])
def test_read_airdialogue_malformed(tmp_path, line, reason):
  path = tmp_path / "dev_data.json"
  path.write_text(_dialogue("A B", ["customer: fine"]) + "\n" + line + "\n")
  with pytest.raises(seqpate.MalformedLineError, match=f":2: .*{reason}"):
    list(seqpate.read_airdialogue(str(path)))
  kept = list(seqpate.read_airdialogue(str(path), on_malformed="skip"))
  assert [s.text for s in kept] == ["fine"]


def test_read_europarl(tmp_path):
  path = tmp_path / "europarl-v6.en"
  path.write_bytes(b"Resumption of the session\n\n  I declare resumed.  \n"
                   b"bad \xff byte\n")
  with pytest.raises(seqpate.MalformedLineError, match=":4: invalid UTF-8"):
    list(seqpate.read_europarl(str(path)))
  got = list(seqpate.read_europarl(str(path), on_malformed="skip"))
  assert [(s.text, s.user_id, s.where) for s in got] == [
      ("Resumption of the session", None, f"{path}:1"),
      ("I declare resumed.", None, f"{path}:3")]


def test_completion_examples_filter_truncate_and_prefix():
  words = [f"w{i}" for i in range(50)]
  sentences = [seqpate.Sentence(" ".join(words[:7]), "u", ""),
               seqpate.Sentence("I  am Janet Miller. I want to fly.", "u", ""),
               seqpate.Sentence(" ".join(words), None, "")]
  got = seqpate.completion_examples(sentences)
  assert got == [
      seqpate.Completion("I am Janet Miller.", "I am Janet Miller. I want to "
                         "fly.", "u"),
      seqpate.Completion("w0 w1 w2 w3", " ".join(words[:40]), None)]


def test_split_examples_is_a_seeded_disjoint_cover():
  items = list(range(101))
  parts = seqpate.split_examples(items, {"private": 0.9, "public": 0.1}, 3)
  assert len(parts["public"]) == 10 and len(parts["private"]) == 91
  assert sorted(parts["private"] + parts["public"]) == items
  assert parts["public"] == sorted(parts["public"])
  assert parts == seqpate.split_examples(items, {"private": 0.9,
                                                 "public": 0.1}, 3)
  with pytest.raises(ValueError, match="sum to at most 1"):
    seqpate.split_examples(items, {"a": 0.8, "b": 0.3}, 0)


class _SampleBPE:
  """The sample's vocab.json + merges.txt through `tokenizers` directly."""

  def __init__(self):
    self._tok = ByteLevelBPETokenizer(
        os.path.join(seqpate.DEFAULT_VOCAB_DIR, "vocab.json"),
        os.path.join(seqpate.DEFAULT_VOCAB_DIR, "merges.txt"))
    self.eos_id = self._tok.get_vocab_size() - 1

  def encode(self, text):
    return self._tok.encode(text).ids

  def decode(self, ids):
    return self._tok.decode(list(ids))


def test_encode_completions_layout():
  vocab = _SampleBPE()
  examples = seqpate.completion_examples(seqpate.load_airdialogue("dev"))[:20]
  arrays = seqpate.encode_completions(examples, vocab, 24)
  eos = vocab.eos_id
  for ex, tokens, weights, p in zip(examples, arrays["tokens"],
                                    arrays["loss_weights"],
                                    arrays["prefix_lengths"]):
    ids = vocab.encode(ex.text)
    n = min(len(ids) + 2, 24)
    assert tokens[0] == eos and (tokens[n:] == eos).all()
    assert vocab.decode(tokens[1:n][tokens[1:n] != eos]) == vocab.decode(
        ids[:n - 1])
    assert weights.tolist() == [0.0] + [1.0] * (n - 1) + [0.0] * (24 - n)
    assert vocab.decode(tokens[1:p]) == ex.prefix
  with pytest.raises(ValueError, match="no room"):
    seqpate.encode_completions(examples, vocab, 4)


def test_completion_splits_keep_users_apart():
  splits = seqpate.completion_splits("airdialogue", 3, public_fraction=0.2,
                                     test_fraction=0.1)
  train = seqpate.completion_examples(seqpate.load_airdialogue("train"))
  private_users = {e.user_id for e in splits["private"]}
  public_users = {e.user_id for e in splits["public"]}
  assert not private_users & public_users
  assert len(splits["private"]) + len(splits["public"]) == len(train)
  users = len(private_users | public_users)
  assert len(public_users) == round(0.2 * users)
  assert splits["test"] == seqpate.completion_examples(
      seqpate.load_airdialogue("dev"))
  europarl = seqpate.completion_splits("europarl", 3, public_fraction=0.2,
                                       test_fraction=0.1)
  assert sum(map(len, europarl.values())) == len(
      seqpate.completion_examples(seqpate.load_europarl()))


def test_private_lm_task_rows_equal_encode_completions():
  # The trainer's rows (seqio task -> decoder-only features) against the
  # table's own encoding of the same private examples.
  from dpjax.data import arrays  # pylint: disable=g-import-not-at-top

  task = seqpate_tasks.register_private_lm_task(
      "airdialogue", 1, public_fraction=0.2, test_fraction=0.1,
      max_examples=64)
  got = arrays.load_task_arrays(task.name, "train", {"targets": 23},
                                converter="decoder_only")
  private = seqpate.completion_splits(
      "airdialogue", 1, public_fraction=0.2, test_fraction=0.1)["private"]
  want = seqpate.encode_completions(private[:64], _SampleBPE(), 24)
  np.testing.assert_array_equal(got["tokens"], want["tokens"])
  np.testing.assert_array_equal(got["loss_weights"], want["loss_weights"])
  # Each row's user (user-level DP): its customer's name, in row order.
  users = arrays.load_task_column(task.name, "train", {"targets": 23},
                                  seqpate_tasks.USER_COLUMN)
  assert [u.decode() for u in users] == [e.user_id for e in private[:64]]
  assert 1 < len(set(users)) < 64  # several sentences per customer


def _sha(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def test_committed_sample_equals_fresh_generation(tmp_path):
  generate.generate(str(tmp_path))
  committed = os.path.dirname(seqpate.DEFAULT_VOCAB_DIR)
  names = [os.path.join(d, f) for d, files in (
      ("airdialogue", ("train_data.json", "dev_data.json", "README.md")),
      ("europarl", ("europarl-v6.en", "README.md")),
      ("vocab", ("vocab.json", "merges.txt", "README.md"))) for f in files]
  for name in names:
    assert _sha(os.path.join(committed, name)) == _sha(
        os.path.join(tmp_path, name)), f"{name}: rerun the generator"
  assert sum(os.path.getsize(os.path.join(committed, n))
             for n in names) < 2 * 2**20
  # Private names occur beyond the 4-word prefix, so leakage is measurable.
  examples = seqpate.completion_examples(seqpate.load_airdialogue("train"))
  with_name = [e for e in examples if e.user_id in e.text[len(e.prefix):]]
  assert len(with_name) > 0.1 * len(examples)


def test_pseudo_data_equals_explicit_greedy_completion():
  config = gpt2.GPT2Config(vocab_size=40, n_positions=16, d_model=16,
                           num_layers=1, num_heads=2, dropout_rate=0.0)
  params, _ = gpt2.init_params(config, jax.random.key(3), max_length=12)
  eos = 39
  prefixes = np.array([[eos, 5, 6, 7], [eos, 8, 9, eos], [eos, 1, eos, eos]])
  lengths = np.array([4, 3, 2])
  out = pseudo_data.complete_prefixes(
      config, params, prefixes, lengths, length=10, rng=jax.random.key(0),
      eos_id=eos, temperature=0.0, batch_size=2)
  forward = jax.jit(lambda t: gpt2.GPT2(config).apply({"params": params}, t))
  for r in range(3):
    row = list(prefixes[r, :lengths[r]])
    while len(row) < 10 and (len(row) == lengths[r] or row[-1] != eos):
      padded = jnp.asarray([row + [eos] * (10 - len(row))])
      row.append(int(jnp.argmax(forward(padded)[0, len(row) - 1])))
    expected = row + [eos] * (10 - len(row))
    assert out["tokens"][r].tolist() == expected
    last = len(row) - 1  # the first EOS after the prefix, or the end
    assert out["loss_weights"][r].tolist() == [0.0] + [1.0] * last + [0.0] * (
        9 - last)
