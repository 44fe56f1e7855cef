"""Lispress parsing, rendering, linearization and function types.

Programs are written by hand in the syntax of the published SMCalFlow 2.0 /
TreeDST files (plus Lispress 1.0 literals); parses are compared with trees
built by hand, function types with hand-listed sets, and every program of the
embedded samples must round-trip.
"""
import glob
import json
import os

import pytest

from dpjax.data.readers import semparse
from dpjax.data.text import lispress
from dpjax.data.text.lispress import Literal, LispressError, Meta, Str, Sym

# (program in the compact form of the .jsonl files, its function types)
PROGRAMS = [
    # Create an event: nested constraints, strings, Long literals.
    ('(Yield (CreateCommitEventWrapper (CreatePreflightEventWrapper (& '
     '(Event.subject_? (?= "Work Shift")) (Event.start_? (?= '
     '(DateAtTimeWithDefaults (MDY 2L (April) (Year.apply 2019L)) '
     '(NumberAM 8L))))))))',
     {"Yield", "CreateCommitEventWrapper", "CreatePreflightEventWrapper", "&",
      "Event.subject_?", "?=", "Event.start_?", "DateAtTimeWithDefaults",
      "MDY", "April", "Year.apply", "NumberAM"}),
    # let binding; type arguments in a head.
    ('(let (x0 (Now)) (Yield (FindEventWrapperWithDefaults '
     '(EventOnDateBeforeTime (DateTime.date x0) (^(Event) EmptyStructConstraint) '
     '(DateTime.time x0)))))',
     {"Now", "Yield", "FindEventWrapperWithDefaults", "EventOnDateBeforeTime",
      "DateTime.date", "EmptyStructConstraint", "DateTime.time"}),
    # Type arguments and a type ascription (^Long) on an argument.
    ('(Yield (^(Long) > ^Long (size (QueryEventResponse.results '
     '(FindEventWrapperWithDefaults (EventDuringRange (^(Event) '
     'EmptyStructConstraint) (ThisWeekend))))) 0L))',
     {"Yield", ">", "size", "QueryEventResponse.results",
      "FindEventWrapperWithDefaults", "EventDuringRange",
      "EmptyStructConstraint", "ThisWeekend"}),
    # Nested refer inside revise (meta-computations).
    ('(Yield (Execute (ReviseConstraint (refer (^(Dynamic) roleConstraint '
     '(Path.apply "output"))) (^(Event) ConstraintTypeIntension) '
     '(Event.attendees_? (AttendeeListHasRecipient (Execute (refer '
     '(extensionConstraint (RecipientWithNameLike (^(Recipient) '
     'EmptyStructConstraint) (PersonName.apply "Dalia"))))))))))',
     {"Yield", "Execute", "ReviseConstraint", "refer", "roleConstraint",
      "Path.apply", "ConstraintTypeIntension", "Event.attendees_?",
      "AttendeeListHasRecipient", "extensionConstraint",
      "RecipientWithNameLike", "EmptyStructConstraint", "PersonName.apply"}),
    # Lispress 1.0: named arguments, #(Type "value") literals, escapes, do.
    ('(do (Yield :output (Execute :intension (confirmAndReturnAction))) '
     '(Yield :output (createCommitEventWrapper (createPreflightEventWrapper '
     '(Constraint[Event] :subject (?= #(String "Sam\'s \\"big\\" day\\tof\\\\fun")) '
     ':start (?= (nextDOW #(DayOfWeek "THURSDAY"))))))))',
     {"Yield", "Execute", "confirmAndReturnAction", "createCommitEventWrapper",
      "createPreflightEventWrapper", "Constraint[Event]", "?=", "nextDOW"}),
    # Lispress 1.0 sugared get `(:start ...)`; non-ASCII string.
    ('(Yield :output (:start (findNextEvent (Constraint[Event] :attendees '
     '(attendeeListHasRecipientConstraint (recipientWithNameLike '
     '(Constraint[Recipient]) #(PersonName "Zoë Ærnsdóttir")))))))',
     {"Yield", ":start", "findNextEvent", "Constraint[Event]",
      "attendeeListHasRecipientConstraint", "recipientWithNameLike",
      "Constraint[Recipient]"}),
    # TreeDST: plan, named arguments, lambda with a typed parameter.
    ('(plan (revise (^(Unit) Path.apply "Book") (^((Constraint Taxi)) '
     'Path.apply "object") (lambda (^(Constraint Taxi) x0) (& x0 '
     '(Taxi.serviceType_? (List.exists_? (?= (ServiceType.Executive))))))))',
     {"plan", "revise", "Path.apply", "&", "Taxi.serviceType_?",
      "List.exists_?", "?=", "ServiceType.Executive"}),
    ('(plan (^(Hotel) Find :focus (Hotel.location_? (^(String) always)) '
     ':object (Hotel.hotelName_? (?= "Moody Moon"))))',
     {"plan", "Find", "Hotel.location_?", "always", "Hotel.hotelName_?", "?="}),
    ("(FenceGibberish)", {"FenceGibberish"}),
    ("()", set()),
]


@pytest.mark.parametrize("text,types", PROGRAMS)
def test_round_trips(text, types):
  program = lispress.parse(text)
  assert lispress.render(program) == text
  linear = lispress.linearize(program)
  assert lispress.parse(linear) == program
  assert lispress.linearize(lispress.parse(linear)) == linear
  assert set(lispress.function_types(text)) == types
  assert len(lispress.function_types(program)) == len(types)  # distinct


def test_parse_builds_the_expected_tree():
  text = ('(let (x0 (Now)) (Yield (^(Event) EmptyStructConstraint) ^Long '
          '(size x0) #(String "a \\"b\\"") 3L :k "é"))')
  expected = (
      Sym("let"), (Sym("x0"), (Sym("Now"),)),
      (Sym("Yield"),
       (Meta((Sym("Event"),), Sym("EmptyStructConstraint")),),
       Meta(Sym("Long"), (Sym("size"), Sym("x0"))),
       Literal((Sym("String"), Str('a "b"'))),
       Sym("3L"), Sym(":k"), Str("é")))
  assert lispress.parse(text) == expected
  # Pretty-printed (multi-line) input parses to the same tree.
  pretty = text.replace(" (Yield", "\n  (Yield\n   ").replace(" ^Long", "\n    ^Long")
  assert lispress.parse(pretty) == expected


def test_linearize_spaces_every_token():
  text = '(Yield (^(Event) EmptyStructConstraint) #(String "two  words"))'
  assert lispress.linearize(text) == (
      '( Yield ( ^ ( Event ) EmptyStructConstraint ) # ( String "two  words" ) )')


def test_string_values_survive_round_trips():
  value = 'tab\there, newline\nthere, "quotes", back\\slash, ünïcode ✓'
  program = (Sym("f"), Str(value))
  for text in (lispress.render(program), lispress.linearize(program)):
    assert lispress.parse(text) == program
    assert "\n" not in text and "\t" not in text  # escaped, one line


def test_function_calls_keep_repeats_in_preorder():
  text = ('(let (x0 (Now) x1 (Tomorrow)) (do (Yield (EventOnDate '
          '(DateTime.date x0) (^(Event) EmptyStructConstraint))) '
          '(Yield (EventOnDate x1 (^(Event) EmptyStructConstraint)))))')
  assert lispress.function_calls(text) == [
      "Now", "Tomorrow", "Yield", "EventOnDate", "DateTime.date",
      "EmptyStructConstraint", "Yield", "EventOnDate", "EmptyStructConstraint"]
  assert lispress.function_types(text) == [
      "Now", "Tomorrow", "Yield", "EventOnDate", "DateTime.date",
      "EmptyStructConstraint"]


def test_symbols_preorder():
  assert list(lispress.symbols('(plan (^(Hotel) Find :object (Hotel.name_? '
                               '(?= "Hotel x"))))')) == [
      "plan", "Hotel", "Find", ":object", "Hotel.name_?", "?="]


@pytest.mark.parametrize("text,message", [
    ("", "empty program"),
    ("   ", "empty program"),
    ("(Yield (Now)", "'(' at character 1 is never closed"),
    ("(Yield (Now)))", "unbalanced ')' at character 14"),
    (")", "unbalanced ')' at character 1"),
    ('(Yield "lunch)', "unterminated string starting at character 8"),
    ('(f "bad \\q escape")', "bad string at character 4"),
    ('(f "raw\nnewline")', "bad string at character 4"),
    ("(^(Event))", "'^' at character 2 is missing a form"),
    ("(f ^Long)", "'^' at character 4 is missing a form"),
    ("(f #String)", "'#' at character 4 must be followed by a list"),
    ("(f #)", "'#' at character 4 is missing a form"),
    ("(Yield (Now)) (Yield (Today))", "another form at character 15"),
    ("(let (x0) (Now))", "let needs a list of (variable value ...) pairs"),
    ("(let x0 (Now))", "let needs a list of (variable value ...) pairs"),
    ('(let ("x0" (Now)) x0)', "let variables must be symbols"),
    ("(lambda (Now))", "lambda needs a parameter list and a body"),
    pytest.param("(" * 5000 + ")" * 5000, "nested too deeply", id="deep"),
])
def test_malformed_programs_raise(text, message):
  with pytest.raises(LispressError) as e:
    lispress.function_types(text)  # parses, then walks the calls
  assert message in str(e.value)
  assert isinstance(e.value, ValueError)


def test_every_sample_program_round_trips():
  files = sorted(glob.glob(os.path.join(semparse.DEFAULT_DATA_DIRS["smcalflow"], "*.jsonl"))
                 + glob.glob(os.path.join(semparse.DEFAULT_DATA_DIRS["treedst"], "*.jsonl")))
  assert len(files) == 4
  n = 0
  for path in files:
    with open(path, encoding="utf-8") as f:
      for line in f:
        for turn in json.loads(line)["turns"]:
          text = turn["lispress"]
          program = lispress.parse(text)
          assert lispress.render(program) == text
          linear = lispress.linearize(program)
          assert lispress.parse(linear) == program
          assert lispress.function_types(program)
          n += 1
  assert n > 3000
