"""SMCalFlow/TreeDST readers, splits, filters, the embedded sample and the
seqio tasks. Expectations come from hand-written files, direct walks over the
JSON, regular expressions over the raw program text, and the `tokenizers` /
`sentencepiece` libraries used directly."""
import collections
import hashlib
import json
import logging
import os
import re

import gin
import pytest
import seqio
import sentencepiece as spm
from tokenizers import ByteLevelBPETokenizer

from dpjax.data.readers import semparse
from dpjax.data.text import lispress
import tasks
from tasks import semparse as semparse_tasks
from tasks.semparse_sample import generate

SAMPLES = semparse.DEFAULT_DATA_DIRS
LENGTHS = {"inputs": 512, "targets": 512}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _turn(index, user, program, skip=False):
  return {"turn_index": index,
          "user_utterance": {"original_text": user, "tokens": user.split()},
          "agent_utterance": {"original_text": f"agent says {index}",
                              "tokens": ["agent", "says", str(index)],
                              "described_entities": []},
          "lispress": program, "skip": skip,
          "program_execution_oracle": {"has_exception": False,
                                       "refer_are_correct": True}}


def _line(dialogue_id, turns):
  return json.dumps({"dialogue_id": dialogue_id, "turns": turns})


def _write(path, lines):
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  return str(path)


CAL_A = _line("d-a", [
    _turn(0, "lunch with Kim tomorrow",
          '(Yield (CreateCommitEventWrapper (CreatePreflightEventWrapper '
          '(Event.subject_? (?= "lunch with Kim")))))'),
    _turn(1, "yes", "(Yield (Execute (^(Dynamic) ConfirmAndReturnAction)))",
          skip=True),
    _turn(2, "what's the weather",
          "(Yield (WeatherQueryApi (AtPlace (Here)) (DateTime.date_? (?= (Today)))))"),
])
CAL_B = _line("d-b", [_turn(0, "who is my manager",
                            "(Yield (FindManager (toRecipient (CurrentUser))))")])


def _raw_walk(path):
  """(dialogue id, turn index, utterance, lispress, agent text, skip) per turn."""
  with open(path, encoding="utf-8") as f:
    return [(d["dialogue_id"], t["turn_index"], t["user_utterance"]["original_text"],
             t["lispress"], t["agent_utterance"]["original_text"], t["skip"])
            for d in map(json.loads, f) for t in d["turns"]]


def _key(t):
  return (t.dialogue_id, t.turn_index)


# ---------------------------------------------------------------------------
# Readers.
# ---------------------------------------------------------------------------


def test_read_turns_keeps_human_turns_without_skip(tmp_path):
  path = _write(tmp_path / "train.jsonl", [CAL_A, "", CAL_B])
  turns = list(semparse.read_turns(path))
  assert [(t.dialogue_id, t.turn_index, t.utterance) for t in turns] == [
      ("d-a", 0, "lunch with Kim tomorrow"), ("d-a", 2, "what's the weather"),
      ("d-b", 0, "who is my manager")]
  assert turns[2].program == "( Yield ( FindManager ( toRecipient ( CurrentUser ) ) ) )"
  assert turns[2].function_types == ("Yield", "FindManager", "toRecipient", "CurrentUser")
  assert all(t.domain is None for t in turns)


@pytest.mark.parametrize("bad,reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({"dialogue_id": "x"}), "missing field 'turns'"),
    (json.dumps({"dialogue_id": 3, "turns": []}), "field 'dialogue_id' must be str"),
    (_line("x", [dict(_turn(0, "a", "(Now)"), turn_index="0")]),
     "turns[0]: field 'turn_index' must be int"),
    (_line("x", [dict(_turn(0, "a", "(Now)"), turn_index=True)]),
     "field 'turn_index' must be int, got bool"),
    (_line("x", [_turn(0, "a", "(Now)"), {k: v for k, v in _turn(1, "b", "(Now)").items()
                                           if k != "skip"}]),
     "turns[1]: missing field 'skip'"),
    (_line("x", [_turn(0, "a", "(Yield (Now)")]),
     "turns[0]: malformed lispress: '(' at character 1 is never closed"),
    (_line("x", [_turn(0, "a", "(let (x0) x0)")]), "malformed lispress: let needs"),
    (_line("x", [_turn(0, "  ", "(Now)")]), "turns[0]: empty user utterance"),
    (_line("x", [dict(_turn(0, "a", "(Now)"), user_utterance={"tokens": []})]),
     "turns[0]: user_utterance: missing field 'original_text'"),
    (CAL_B, "duplicate dialogue_id 'd-b'"),
])
def test_malformed_line_errors(tmp_path, caplog, bad, reason):
  path = _write(tmp_path / "x.jsonl", [CAL_B, bad, CAL_A])
  with pytest.raises(semparse.MalformedLineError) as e:
    list(semparse.read_turns(path))
  assert str(e.value).startswith(f"{path}:2: ")
  assert reason in str(e.value)
  with caplog.at_level(logging.WARNING):
    kept = list(semparse.read_turns(path, on_malformed="skip"))
  assert [t.dialogue_id for t in kept] == ["d-b", "d-a", "d-a"]
  assert f"Skipped 1 malformed dialogues in {path} (first: {path}:2:" in caplog.text


def test_invalid_utf8_and_bad_policy(tmp_path):
  path = tmp_path / "x.jsonl"
  path.write_bytes(CAL_B.encode() + b"\n\xff\xfe\n")
  with pytest.raises(semparse.MalformedLineError, match=rf"{path}:2: invalid UTF-8"):
    list(semparse.read_turns(str(path)))
  with pytest.raises(ValueError, match="on_malformed"):
    list(semparse.read_turns(str(path), on_malformed="ignore"))


@pytest.mark.parametrize("dataset", semparse.DATASETS)
@pytest.mark.parametrize("split", ["train", "validation"])
def test_sample_turns_match_a_direct_json_walk(dataset, split):
  raw = _raw_walk(os.path.join(SAMPLES[dataset], semparse.SPLIT_FILES[split]))
  turns = semparse.load_turns(dataset, split)
  expected = [(d, i, u, p) for d, i, u, p, _, skip in raw if not skip]
  assert [(t.dialogue_id, t.turn_index, t.utterance, lispress.render(t.program))
          for t in turns] == expected
  assert len(raw) > len(turns)  # some turns are skipped
  agent = {a for *_, a, _ in raw}
  assert not agent & {t.utterance for t in turns}  # agent side never an example
  assert (200 if split == "validation" else 1400) <= len(turns) <= 2 * (
      300 if split == "validation" else 1800)


# ---------------------------------------------------------------------------
# TreeDST domains.
# ---------------------------------------------------------------------------


def test_treedst_domains_by_hand(tmp_path):
  revise_taxi = ('(plan (revise (^(Unit) Path.apply "Book") (^((Constraint Taxi)) '
                 'Path.apply "object") (lambda (^(Constraint Taxi) x0) x0)))')
  path = _write(tmp_path / "t.jsonl", [
      _line("one", [
          _turn(0, "hi", "(plan (^(Unit) Greet))"),
          _turn(1, "hotel near the taxi rank",
                '(plan (^(Hotel) Find :object (Hotel.location_? '
                '(Location.name_? (?= "Taxi rank")))))'),
          _turn(2, "thanks", "(plan (^(Unit) EndConversation))"),
          _turn(3, "make it an executive car", revise_taxi),
          _turn(4, "bye", "(plan (^(Unit) EndConversation))", skip=True)]),
      _line("two", [_turn(0, "hello", "(plan (^(Unit) Greet))")])])
  turns = list(semparse.read_turns(path, with_domains=True))
  assert [(t.dialogue_id, t.domain) for t in turns] == [
      ("one", "hotel"), ("one", "hotel"), ("one", "hotel"), ("one", "taxi"),
      ("two", semparse.UNKNOWN_DOMAIN)]
  assert semparse.treedst_domain("(Flight.origin_? (Location.name_? (?= \"x\")))") == "flight"
  assert semparse.treedst_domain("(plan (^(Weather) Find :object (?= 1L)))") == "weather"
  assert semparse.treedst_domain('(plan (^(Unit) Say "Hotel"))') is None


def test_sample_domains_match_a_regex_over_the_raw_programs():
  names = "|".join(semparse.TREEDST_DOMAIN_TYPES)
  type_re = re.compile(rf"(?<![\w.])({names})(?!\w)")
  raw = _raw_walk(os.path.join(SAMPLES["treedst"], semparse.SPLIT_FILES["train"]))
  by_dialogue = collections.defaultdict(list)
  for d, _, _, program, _, skip in raw:
    m = type_re.search(_STRING.sub('""', program))
    by_dialogue[d].append((m and semparse.TREEDST_DOMAIN_TYPES[m.group(1)], skip))
  expected = []
  for labels in by_dialogue.values():
    known = [x for x, _ in labels if x]
    current = known[0] if known else semparse.UNKNOWN_DOMAIN
    for label, skip in labels:
      current = label or current
      if not skip:
        expected.append(current)
  turns = semparse.load_turns("treedst", "train")
  assert [t.domain for t in turns] == expected
  assert set(expected) == set(semparse.TREEDST_DOMAIN_TYPES.values())


# ---------------------------------------------------------------------------
# Public/private split and function filters.
# ---------------------------------------------------------------------------


def test_public_private_split():
  turns = semparse.load_turns("smcalflow", "train")
  public = semparse.select_portion(turns, "public", seed=3)
  private = semparse.select_portion(turns, "private", seed=3)
  keys = [_key(t) for t in turns]
  assert len(set(keys)) == len(keys)
  assert len(public) == round(0.1 * len(turns))
  assert {_key(t) for t in public}.isdisjoint({_key(t) for t in private})
  assert sorted(map(_key, public + private)) == sorted(keys)
  public_keys = {_key(t) for t in public}
  assert public == [t for t in turns if _key(t) in public_keys]  # file order
  assert semparse.select_portion(turns, "public", seed=3) == public
  assert semparse.select_portion(turns, "public", seed=4) != public
  assert semparse.select_portion(turns, "all") == turns
  quarter = semparse.select_portion(turns, "public", seed=3, public_fraction=0.25)
  assert len(quarter) == round(0.25 * len(turns))
  with pytest.raises(ValueError, match="portion"):
    semparse.select_portion(turns, "secret")
  with pytest.raises(ValueError, match="public_fraction"):
    semparse.select_portion(turns, "public", public_fraction=1.5)


@pytest.mark.parametrize("patterns,call_re", [
    (semparse.PAPER_EXCLUSIONS["weather"], r"\(Weather[\w.]*[ )]"),
    (semparse.PAPER_EXCLUSIONS["eod"], r"\(EventOnDate[ )]"),
    (("FindManager", "FindReports"), r"\((FindManager|FindReports)[ )]"),
])
def test_drop_functions_removes_exactly_the_calling_examples(patterns, call_re):
  path = os.path.join(SAMPLES["smcalflow"], semparse.SPLIT_FILES["train"])
  calls = {(d, i) for d, i, _, program, _, skip in _raw_walk(path)
           if not skip and re.search(call_re, _STRING.sub('""', program))}
  turns = semparse.load_turns("smcalflow", "train")
  kept = semparse.drop_functions(turns, patterns)
  assert calls and {_key(t) for t in kept} == {_key(t) for t in turns} - calls
  assert len(kept) == len(turns) - len(calls)


def test_eod_pattern_keeps_other_event_on_date_functions():
  turns = semparse.load_turns("smcalflow", "train")
  after = [t for t in turns if "EventOnDateAfterTime" in t.function_types]
  assert after and set(map(_key, after)) <= set(map(_key, semparse.drop_functions(
      turns, semparse.PAPER_EXCLUSIONS["eod"])))


# ---------------------------------------------------------------------------
# seqio tasks.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registered():
  return {t.name: t for t in semparse_tasks.register_semparse_tasks()}


@pytest.fixture(scope="module")
def bpe():
  return ByteLevelBPETokenizer(semparse_tasks.DEFAULT_BPE_VOCAB_PATH,
                               semparse_tasks.DEFAULT_BPE_MERGES_PATH)


@pytest.fixture(scope="module")
def sp():
  return spm.SentencePieceProcessor(model_file=semparse_tasks.DEFAULT_SENTENCEPIECE_PATH)


def _expected_texts(kind, utterance, program, domain):
  linear = lispress.linearize(program)
  return {
      "utterance_lm": ("", utterance),
      "domain_to_utterance": (f"domain: {domain}\nutterance:", utterance),
      "parse_lm": ("", linear),
      "parse_to_utterance": (f"parse: {linear}\nutterance:", utterance),
      "parser": (utterance, linear),
  }[kind]


def test_task_names_and_features(registered):
  assert sorted(registered) == sorted(
      ["smcalflow_utterance_lm", "smcalflow_parse_lm",
       "smcalflow_parse_to_utterance", "smcalflow_parser",
       "treedst_utterance_lm", "treedst_domain_to_utterance", "treedst_parse_lm",
       "treedst_parse_to_utterance", "treedst_parser"])
  for name, task in registered.items():
    assert seqio.get_mixture_or_task(name) is task
    inputs, targets = task.output_features["inputs"], task.output_features["targets"]
    assert targets.add_eos and inputs.add_eos == name.endswith("_parser")
    vocab = targets.vocabulary
    if name.endswith("_parser"):
      assert isinstance(vocab, seqio.SentencePieceVocabulary)
      assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
    else:
      assert vocab.eos_id == vocab.vocab_size - 1  # GPT-2's layout


@pytest.mark.parametrize("name", [
    "smcalflow_utterance_lm", "smcalflow_parse_lm", "smcalflow_parse_to_utterance",
    "smcalflow_parser", "treedst_utterance_lm", "treedst_domain_to_utterance",
    "treedst_parse_lm", "treedst_parse_to_utterance", "treedst_parser"])
def test_task_examples(registered, bpe, sp, name):
  dataset, kind = name.split("_", 1)
  task = registered[name]
  path = os.path.join(SAMPLES[dataset], semparse.SPLIT_FILES["validation"])
  raw = [r for r in _raw_walk(path) if not r[-1]]
  domains = [t.domain for t in semparse.load_turns(dataset, "validation")]
  examples = list(task.get_dataset(LENGTHS, split="validation", shuffle=False)
                  .as_numpy_iterator())
  assert len(examples) == len(raw)
  vocab = task.output_features["targets"].vocabulary
  for ex, (d, i, utterance, program, _, _), domain in list(zip(examples, raw, domains))[:4]:
    inputs, targets = _expected_texts(kind, utterance, program, domain)
    assert ex["inputs_pretokenized"].decode() == inputs
    assert ex["targets_pretokenized"].decode() == targets
    assert (ex["dialogue_id"].decode(), int(ex["turn_index"])) == (d, i)
    assert ("domain" in ex) == (dataset == "treedst")
    if kind == "parser":
      assert list(ex["inputs"]) == sp.encode(inputs) + [1]
      assert list(ex["targets"]) == sp.encode(targets) + [1]
    else:
      assert list(ex["inputs"]) == bpe.encode(inputs).ids
      assert list(ex["targets"]) == bpe.encode(targets).ids + [vocab.eos_id]
    assert vocab.decode(ex["targets"].tolist()) == targets
    assert vocab.decode(ex["inputs"].tolist()) == inputs


def test_parser_portion_and_exclusion():
  name = "test_smcalflow_parser_public_no_weather"
  try:
    task = semparse_tasks.register_semparse_task(
        name, "smcalflow", "parser", portion="public", split_seed=7,
        exclude_functions=semparse.PAPER_EXCLUSIONS["weather"])
    counts = {}
    for split in ("train", "validation"):
      public = semparse.select_portion(semparse.load_turns("smcalflow", split),
                                       "public", seed=7)
      ds = task.get_dataset(LENGTHS, split=split, shuffle=False)
      targets = [ex["targets_pretokenized"].decode() for ex in ds.as_numpy_iterator()]
      weather = [t for t in public if "WeatherQueryApi" in t.function_types]
      counts[split] = (len(targets), len(public), len(weather))
      if split == "train":  # D_pub without Weather
        assert weather and not any("Weather" in t for t in targets)
        assert targets == [t.program for t in public if t not in weather]
      else:  # the 1/10 test subsample keeps them
        assert targets == [t.program for t in public]
    assert counts["train"][0] == counts["train"][1] - counts["train"][2]
  finally:
    seqio.TaskRegistry.remove(name)


def test_register_tasks_with_gin_and_errors(tmp_path):
  tiny = tmp_path / "cal"
  tiny.mkdir()
  _write(tiny / "train.dataflow_dialogues.jsonl", [CAL_A])
  _write(tiny / "valid.dataflow_dialogues.jsonl", [CAL_B])
  try:
    gin.parse_config([f"register_semparse_tasks.smcalflow_dir = '{tiny}'"])
    names = tasks.register_tasks()
    assert "smcalflow_utterance_lm" in names and "treedst_parser" in names
    ds = seqio.get_mixture_or_task("smcalflow_utterance_lm").get_dataset(
        LENGTHS, split="train", shuffle=False)
    assert [ex["targets_pretokenized"].decode() for ex in ds.as_numpy_iterator()] == [
        "lunch with Kim tomorrow", "what's the weather"]
  finally:
    gin.clear_config()
    semparse_tasks.register_semparse_tasks()  # back to the samples
  with pytest.raises(FileNotFoundError, match="valid.dataflow_dialogues.jsonl"):
    (tmp_path / "only_train").mkdir()
    _write(tmp_path / "only_train" / "train.dataflow_dialogues.jsonl", [CAL_A])
    semparse_tasks.register_semparse_task("test_never", "smcalflow", "parser",
                                    data_dir=str(tmp_path / "only_train"))
  with pytest.raises(ValueError, match="task kinds"):
    semparse_tasks.register_semparse_task("test_never", "smcalflow", "domain_to_utterance")
  with pytest.raises(ValueError, match="portion"):
    semparse_tasks.register_semparse_task("test_never", "treedst", "parser", portion="half")
  with pytest.raises(ValueError, match="both bpe_vocab_path and bpe_merges_path"):
    semparse_tasks.register_semparse_tasks(semparse_tasks.SemparseConfig(
        bpe_vocab_path=semparse_tasks.DEFAULT_BPE_VOCAB_PATH))
  with pytest.raises(FileNotFoundError, match="SentencePiece"):
    semparse_tasks.register_semparse_tasks(semparse_tasks.SemparseConfig(
        sentencepiece_path=str(tmp_path / "x.model")))
  assert "test_never" not in seqio.TaskRegistry.names()


# ---------------------------------------------------------------------------
# The embedded sample is what the committed generator writes.
# ---------------------------------------------------------------------------


def _sha(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def test_committed_sample_equals_fresh_generation(tmp_path):
  generate.generate(str(tmp_path))
  committed = os.path.dirname(semparse_tasks.DEFAULT_VOCAB_DIR)
  names = [os.path.join(generate.DIRS[d], f) for d in semparse.DATASETS
           for f in list(semparse.SPLIT_FILES.values()) + ["README.md"]]
  names += [os.path.join(generate.DIRS["vocab"], f)
            for f in ("vocab.json", "merges.txt", "README.md")]
  for name in names:
    assert _sha(os.path.join(committed, name)) == _sha(
        os.path.join(tmp_path, name)), f"{name}: rerun the generator"
  model = os.path.join(generate.DIRS["vocab"], generate.SPM_MODEL_NAME + ".model")
  new = spm.SentencePieceProcessor(model_file=os.path.join(tmp_path, model))
  old = spm.SentencePieceProcessor(model_file=os.path.join(committed, model))
  assert [old.id_to_piece(i) for i in range(old.get_piece_size())] == [
      new.id_to_piece(i) for i in range(new.get_piece_size())]
  total = sum(os.path.getsize(os.path.join(committed, n)) for n in names)
  assert total < 3 * 2**20
