"""MultiDoGo readers, formatting, chunking, splits, the embedded sample and
the seqio tasks. Expectations are hand-written files and strings, the
vocabulary's own `encode` of hand-written texts, and counts by hand."""
import csv
import io
import json
import logging
import random

import gin
import numpy as np
import pytest
import seqio

from dpjax.data import arrays
from dpjax.data.readers import multidogo
from dpjax.data.readers.multidogo import Conversation, Utterance
from dpjax.data.text import redaction
from dpjax.data.text.redaction import REDACTED as R
from tasks import multidogo as multidogo_tasks
from tasks.multidogo_sample import generate

HEADER = "conversationId\tturnNumber\tutteranceId\tutterance\tauthorRole"
# Two interleaved conversations, rows out of turn order, a quoted utterance
# spanning two lines (3-4), a blank line, a whitespace-only utterance and a
# "3.0" turn.
TSV = "\n".join([
    HEADER,
    "c2\t1\tu21\tmy seat please\tcustomer",
    'c1\t2\tu12\t"Sure! Your\n  seat is 4A."\tagent',
    "c1\t0\tu10\tHello, you reached Skylark Airways!\tagent",
    "c2\t0\tu20\tHi\tagent",
    "  ",
    "c1\t1\tu11\t  i want my   seat \tcustomer",
    "c1\t3.0\tu13\t   \tcustomer",
    "c2\t2\tu22\tdone\tbot",
    "",
]) + "\n"
EXPECTED = [
    Conversation("AIRLINE", "c1", (
        Utterance(0, "agent", "Hello, you reached Skylark Airways!"),
        Utterance(1, "customer", "i want my seat"),
        Utterance(2, "agent", "Sure! Your seat is 4A."))),
    Conversation("AIRLINE", "c2", (
        Utterance(0, "agent", "Hi"),
        Utterance(1, "customer", "my seat please"),
        Utterance(2, "bot", "done"))),
]


def _write(path, text, encoding="utf-8"):
  path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
  return str(path)


def _as_csv(tsv):
  rows = list(csv.reader(io.StringIO(tsv), delimiter="\t"))
  buf = io.StringIO()
  csv.writer(buf, lineterminator="\n").writerows(rows)
  return buf.getvalue()


@pytest.mark.parametrize("delimited", [lambda s: s, _as_csv], ids=["tab", "comma"])
def test_read_groups_orders_and_normalises(tmp_path, delimited):
  path = _write(tmp_path / "airline.tsv", delimited(TSV))
  assert multidogo.read_conversations(path, "AIRLINE") == EXPECTED


def test_extra_columns_and_column_order(tmp_path):
  text = ("\ufeffauthorRole,utterance,conversationId,turnNumber,intent\n"
          "customer,\"hi, there\",x,1,greet\nagent,welcome,x,0,none\n")
  path = _write(tmp_path / "media.tsv", text)
  assert multidogo.read_conversations(path, "MEDIA") == [Conversation(
      "MEDIA", "x", (Utterance(0, "agent", "welcome"),
                     Utterance(1, "customer", "hi, there")))]


@pytest.mark.parametrize("bad,reason", [
    ("c1\tx\tu\thi\tcustomer", "turnNumber must be a non-negative integer, got 'x'"),
    ("c1\t-1\tu\thi\tcustomer", "turnNumber must be a non-negative integer"),
    ("c1\t2.5\tu\thi\tcustomer", "turnNumber must be a non-negative integer"),
    ("c1\t4\tu\thi\trobot", "authorRole must be one of ['agent', 'bot', 'customer'], "
                            "got 'robot'"),
    ("c1\t4\tu\thi", "expected 5 columns, got 4"),
    ("\t4\tu\thi\tagent", "empty conversationId"),
    ('c1\t4\tu\t"hi"x\tagent', "malformed CSV"),
    (b"c1\t4\tu\th\xffi\tagent", "invalid UTF-8"),
])
def test_malformed_rows(tmp_path, caplog, bad, reason):
  # Line 2-3 hold one quoted record, so the bad record is on line 4.
  good = HEADER + '\nc1\t0\tu\t"two\nlines"\tagent\n'
  tail = "c2\t0\tu\tok\tcustomer\n"
  raw = (good.encode() + (bad if isinstance(bad, bytes) else bad.encode())
         + b"\n" + tail.encode())
  path = _write(tmp_path / "airline.tsv", raw)
  with pytest.raises(multidogo.MalformedLineError) as e:
    multidogo.read_conversations(path, "AIRLINE")
  assert str(e.value).startswith(f"{path}:4: ")
  assert reason in str(e.value)
  with caplog.at_level(logging.WARNING):
    kept = multidogo.read_conversations(path, "AIRLINE", on_malformed="skip")
  assert [(c.conversation_id, [u.text for u in c.utterances]) for c in kept] == [
      ("c1", ["two lines"]), ("c2", ["ok"])]
  assert f"Skipped 1 malformed rows in {path} (first: {path}:4:" in caplog.text


def test_bad_header_and_files(tmp_path):
  path = _write(tmp_path / "airline.tsv", "conversationId,turn,utterance,authorRole\n")
  with pytest.raises(multidogo.MalformedLineError, match=r":1: header lacks columns "
                                                          r"\['turnNumber'\]"):
    multidogo.read_conversations(path, "AIRLINE", on_malformed="skip")
  with pytest.raises(FileNotFoundError, match="media.tsv"):
    multidogo.load_conversations(str(tmp_path), ["MEDIA"])
  with pytest.raises(ValueError, match="domain must be one of"):
    multidogo.load_conversations(str(tmp_path), ["AIRLINES"])


def test_format_conversation():
  c = EXPECTED[0]
  assert multidogo.format_conversation(c) == (
      "<_soc_> <AIRLINE> SYS: Hello, you reached Skylark Airways! "
      "<AIRLINE> USR: i want my seat <AIRLINE> SYS: Sure! Your seat is 4A. <_eoc_>")
  assert multidogo.format_conversation(c, domain_tokens=False) == (
      "<_soc_> SYS: Hello, you reached Skylark Airways! USR: i want my seat "
      "SYS: Sure! Your seat is 4A. <_eoc_>")
  policy = redaction.KeywordPolicy({"AIRLINE": ["seat", "Skylark Airways"]})
  (red,) = multidogo.redact_conversations([c], policy)
  assert multidogo.format_conversation(red) == (
      f"<_soc_> <AIRLINE> SYS: Hello, you reached {R} {R}! "
      f"<AIRLINE> USR: i want my {R} <AIRLINE> SYS: Sure! Your {R} is 4A. <_eoc_>")


def test_chunking():
  rng = np.random.default_rng(0)
  ids = [rng.integers(0, 50, n) for n in (5, 12, 0, 7)]
  domains = ["AIRLINE", "MEDIA", "MEDIA", "AIRLINE"]
  assert [len(c) for c in multidogo.chunk_ids(np.arange(10), 4)] == [4, 4, 2]
  assert multidogo.chunk_ids(np.arange(0), 4) == []
  chunks, cd = multidogo.chunk_conversations(ids, domains, 4, pack=True)
  # Packed: per domain, the concatenated conversations cut every 4 tokens.
  assert cd == ["AIRLINE"] * 3 + ["MEDIA"] * 3
  assert [len(c) for c in chunks] == [4, 4, 4, 4, 4, 4]
  np.testing.assert_array_equal(np.concatenate(chunks[:3]), np.concatenate([ids[0], ids[3]]))
  np.testing.assert_array_equal(np.concatenate(chunks[3:]), ids[1])
  chunks, cd = multidogo.chunk_conversations(ids, domains, 4, pack=False)
  assert [len(c) for c in chunks] == [4, 1, 4, 4, 4, 4, 3]
  assert cd == ["AIRLINE"] * 2 + ["MEDIA"] * 3 + ["AIRLINE"] * 2
  np.testing.assert_array_equal(np.concatenate(chunks), np.concatenate(ids))


@pytest.fixture(scope="module")
def sample():
  return multidogo.load_conversations()


def test_sample_is_the_generators_output(sample):
  for domain in generate.SEEDS:
    with open(multidogo.domain_path(multidogo.DEFAULT_DATA_DIR, domain),
              encoding="utf-8", newline="") as f:
      assert f.read() == generate.build(domain)
  with open(multidogo.DEFAULT_KEYWORDS_PATH, encoding="utf-8") as f:
    assert json.load(f) == {d: [*generate.COMPANIES[d], *generate.KEYWORDS[d]]
                            for d in generate.SEEDS}
  assert [sum(c.domain == d for c in sample) for d in multidogo.PAPER_DOMAINS] == [300] * 3


def test_split_by_conversation(sample):
  splits = {s: multidogo.split_conversations(sample, s) for s in multidogo.SPLITS}
  for domain in multidogo.PAPER_DOMAINS:
    ids = {s: {c.conversation_id for c in v if c.domain == domain}
           for s, v in splits.items()}
    assert [len(ids[s]) for s in multidogo.SPLITS] == [180, 60, 60]  # 0.6/0.2/0.2 of 300
    assert set.union(*ids.values()) == {c.conversation_id for c in sample
                                        if c.domain == domain}
  # Independent of the other domains and of the order of the rows.
  airline = [c for c in sample if c.domain == "AIRLINE"]
  shuffled = random.Random(0).sample(airline, len(airline))
  assert multidogo.split_conversations(shuffled, "test") == [
      c for c in splits["test"] if c.domain == "AIRLINE"]
  assert multidogo.split_conversations(sample, "test", seed=1) != splits["test"]
  # Rounding: 7 conversations -> 4 / 1 / 2.
  seven = airline[:7]
  assert [len(multidogo.split_conversations(seven, s)) for s in multidogo.SPLITS] == [4, 1, 2]


# ---------------------------------------------------------------------------
# seqio tasks on a hand-written directory.
# ---------------------------------------------------------------------------

HAND = {  # conversation id -> (rows, expected formatted text)
    f"a{i}": ([("agent", f"Welcome to Skylark Airways, call {i}."),
               ("customer", f"i want seat {i}A")],
              f"<_soc_> <AIRLINE> SYS: Welcome to Skylark Airways, call {i}. "
              f"<AIRLINE> USR: i want seat {i}A <_eoc_>")
    for i in range(5)}
HAND.update({
    f"m{i}": ([("customer", "my zip code changed"), ("agent", f"noted, ticket {i}")],
              f"<_soc_> <MEDIA> USR: my zip code changed <MEDIA> SYS: noted, ticket {i} "
              "<_eoc_>")
    for i in range(5)})
HAND_REDACTED = {k: v[1].replace("Skylark Airways", f"{R} {R}")
                 .replace("seat", R).replace("zip code", f"{R} {R}")
                 for k, v in HAND.items()}


@pytest.fixture(scope="module")
def hand_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("dogo")
  for domain, prefix in (("airline", "a"), ("media", "m")):
    rows = ["conversationId,turnNumber,utteranceId,utterance,authorRole"]
    rows += [f'{cid},{t},x,"{text}",{role}' for cid, (turns, _) in HAND.items()
             if cid.startswith(prefix) for t, (role, text) in enumerate(turns)]
    (path / f"{domain}.tsv").write_text("\n".join(rows) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def vocabulary():
  return multidogo_tasks.dialog_vocabulary()


def _decoded_targets(name, split, vocabulary):
  ds = seqio.get_mixture_or_task(name).get_dataset(
      {"inputs": 1, "targets": 4096}, split=split, shuffle=False, use_cached=False)
  exs = list(ds.as_numpy_iterator())
  assert all(e["inputs"].shape == (0,) for e in exs)
  return [(e["domain"].decode(), vocabulary.decode(e["targets"])) for e in exs]


def test_task_text(hand_dir, vocabulary):
  policy = lambda: redaction.KeywordPolicy(
      {"AIRLINE": ["seat", "Skylark Airways"], "MEDIA": ["zip code"]})
  multidogo_tasks.register_multidogo_task(
      "test_dogo", data_dir=hand_dir, domains=("AIRLINE", "MEDIA"),
      chunk_length=4096, vocabulary=vocabulary)
  multidogo_tasks.register_multidogo_task(
      "test_dogo_red", data_dir=hand_dir, domains=("AIRLINE", "MEDIA"), policy=policy,
      chunk_length=4096, vocabulary=vocabulary)
  conversations = multidogo.load_conversations(hand_dir, ("AIRLINE", "MEDIA"))
  for split in multidogo.SPLITS:
    ids = {d: [c.conversation_id for c in multidogo.split_conversations(
        conversations, split) if c.domain == d] for d in ("AIRLINE", "MEDIA")}
    assert [len(v) for v in ids.values()] == [{"train": 3, "validation": 1, "test": 1}[split]] * 2
    # One packed chunk per domain: its conversations back to back.
    assert _decoded_targets("test_dogo", split, vocabulary) == [
        (d, "".join(HAND[i][1] for i in v)) for d, v in ids.items()]
    assert _decoded_targets("test_dogo_red", split, vocabulary) == [
        (d, "".join(HAND_REDACTED[i] for i in v)) for d, v in ids.items()]


def test_task_chunks_and_features(hand_dir, vocabulary):
  multidogo_tasks.register_multidogo_task(
      "test_dogo_small", data_dir=hand_dir, domains=("MEDIA",), chunk_length=7,
      domain_tokens=False, pack=False, vocabulary=vocabulary)
  train = multidogo.split_conversations(
      multidogo.load_conversations(hand_dir, ("MEDIA",)), "train")
  texts = [HAND[c.conversation_id][1].replace("<MEDIA> ", "") for c in train]
  expected = [vocabulary.encode(t) for t in texts]
  feats = arrays.load_task_arrays("test_dogo_small", "train", {"inputs": 1, "targets": 7},
                                  converter="decoder_only")
  lengths = feats["attention_mask"].sum(1) - 1  # without the BOS
  assert lengths.tolist() == [min(7, len(e) - s) for e in expected
                              for s in range(0, len(e), 7)]
  chunks = [row[1:1 + n] for row, n in zip(feats["tokens"], lengths)]
  np.testing.assert_array_equal(np.concatenate(chunks), np.concatenate(expected))
  assert (feats["tokens"][:, 0] == vocabulary.eos_id).all()
  np.testing.assert_array_equal(feats["loss_weights"].sum(1), lengths)
  # Every control token is one id.
  assert [len(vocabulary.encode(t)) for t in multidogo.CONTROL_TOKENS] == [1] * 11


def test_register_multidogo_tasks():
  gin.clear_config()  # the defaults, whatever ran before
  names = [t.name for t in multidogo_tasks.register_multidogo_tasks()]
  assert names == ["multidogo_lm", "multidogo_lm_redacted_keyword",
                   "multidogo_lm_only_airline", "multidogo_lm_without_airline",
                   "multidogo_lm_only_media", "multidogo_lm_without_media",
                   "multidogo_lm_only_insurance", "multidogo_lm_without_insurance"]
  vocab = seqio.get_mixture_or_task("multidogo_lm").output_features["targets"].vocabulary
  assert vocab.vocab_size == 2000 + len(multidogo.CONTROL_TOKENS)
