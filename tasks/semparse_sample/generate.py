"""Deterministic generator of small SMCalFlow 2.0- and TreeDST-format samples.

Run ``python -m tasks.semparse_sample.generate`` (optionally ``--output_dir``)
to (re)create, under ``tasks/data/``:

* ``smcalflow_sample/{train,valid}.dataflow_dialogues.jsonl``: calendar
  dialogues (create / find / update / delete events, EventOnDate queries,
  weather, org chart, places, `let`, refer / revise follow-ups, confirmations,
  pleasantries and fences) with Lispress 2.0 programs;
* ``treedst_sample/{train,valid}.dataflow_dialogues.jsonl``: TreeDST-shaped
  dialogues over 10 domains (`tasks.semparse.TREEDST_DOMAIN_TYPES`) with
  `plan` / `Find` / `Book` / `Create` programs and `revise` + `lambda`
  follow-ups;
* ``semparse_vocab/``: GPT-2-format byte-level BPE files (``vocab.json``,
  ``merges.txt``: the 256 byte tokens first, ``<|endoftext|>`` last, as in
  GPT-2) and a T5-style SentencePiece model (``semparse_sample.model``: pad 0,
  eos 1, unk 2, no bos), both trained on the train splits' task texts;
* a ``README.md`` with statistics in each directory.

Files are in the published dataflow-dialogue format (one JSON dialogue per
line; see `tasks.semparse`). Every turn has a user and an agent utterance;
some confirmations are marked ``skip`` as in the real data. All names,
places and subjects are invented. An utterance and its program are made
together from the same slot values, so the pairs are consistent.

Determinism: one ``random.Random`` per file from fixed seeds, only ordered
containers; BPE is trained on a fixed list of texts; SentencePiece with one
thread, no sampling or shuffling and a fixed seed, and its proto is stored
without the output path.

Needs the standard library, ``tokenizers``, ``sentencepiece`` and the
(pure Python) `tasks.semparse` readers; no TensorFlow.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import string

from dpjax.datasets import semparse
from dpjax.text import lispress
from tasks import semparse as semparse_tasks

SEEDS = {("smcalflow", "train"): 3101, ("smcalflow", "valid"): 3102,
         ("treedst", "train"): 4101, ("treedst", "valid"): 4102}
NUM_DIALOGUES = {"train": 720, "valid": 110}
BPE_VOCAB_SIZE = 2000  # at most, including <|endoftext|>
SPM_VOCAB_SIZE = 800
SPM_SEED = 1234
SPM_MODEL_NAME = "semparse_sample"
EOS_TOKEN = "<|endoftext|>"

DEFAULT_OUTPUT_DIR = os.path.dirname(semparse_tasks.DEFAULT_VOCAB_DIR)
DIRS = {"smcalflow": "smcalflow_sample", "treedst": "treedst_sample",
        "vocab": "semparse_vocab"}
FILE_SPLITS = {"train": "train", "validation": "valid"}

# ---------------------------------------------------------------------------
# Shared vocabulary of the invented world.
# ---------------------------------------------------------------------------

_FIRST = ("Arvel", "Bretta", "Corin", "Dalia", "Edrin", "Fenna", "Garrick",
          "Hesper", "Ilsa", "Joran", "Kestra", "Lorne", "Mirela", "Nolan",
          "Oriel", "Petra", "Quill", "Rosalind", "Soren", "Tamsin", "Ulric",
          "Vesna", "Wendel", "Yara", "Zora", "Alder", "Briony", "Casimir")
_LAST = ("Vantrell", "Oakhurst", "Brisby", "Calloway", "Dunmore", "Ellery",
         "Farrow", "Galloway", "Hartwell", "Isley", "Jessup", "Kettering",
         "Larkspur", "Merriweather", "Norcott", "Pembrook")
_TOWNS = ("Brindlemere", "Quillmora", "Thornwick", "Duskhollow", "Marrowby",
          "Elderstead", "Fenwyck", "Glimmerport", "Halvardton", "Ivybridge",
          "Juniper Falls", "Kestrel Bay", "Lowmoor", "Mistral Point",
          "Northaven", "Oxenford")
_VENUES = ("Marigold Cafe", "the Copper Kettle", "Bramble Bistro",
           "the Lantern Room", "Saffron House", "the Old Mill Tavern",
           "Willow and Wren", "the Blue Heron", "Tidewater Grill",
           "the Gilded Fern")
_ROOMS = ("conference room B", "the atrium", "the library", "my office",
          "the boardroom", "room 4", "the cafeteria", "the garden terrace")
_SUBJECTS = ("team sync", "budget review", "lunch", "dentist appointment",
             "yoga class", "design review", "coffee", "one on one",
             "book club", "piano lesson", "haircut", "project kickoff",
             "dinner", "standup", "interview", "offsite planning",
             "soccer practice", "parent teacher conference", "code review",
             "quarterly planning", "study group", "vet appointment",
             "pottery class", "sprint retro")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
         "Sunday")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July",
           "August", "September", "October", "November", "December")


def _tokens(text: str) -> list[str]:
  """Word and punctuation tokens, as in the dataset's `tokens` fields."""
  return re.findall(r"\w+(?:'\w+)?|[^\w\s]", text)


def _date(rng: random.Random) -> tuple[str, str]:
  """(phrase, Lispress) of a date."""
  r = rng.random()
  if r < 0.25:
    return "today", "(Today)"
  if r < 0.5:
    return "tomorrow", "(Tomorrow)"
  if r < 0.8:
    day = rng.choice(_DAYS)
    return rng.choice((f"on {day}", f"next {day}", f"this {day}")), \
        f"(NextDOW ({day}))"
  month, day = rng.choice(_MONTHS), rng.randint(1, 28)
  return f"on {month} {day}", f"(MD {day}L ({month}))"


def _time(rng: random.Random) -> tuple[str, str]:
  """(phrase, Lispress) of a time of day."""
  r = rng.random()
  if r < 0.1:
    return "at noon", "(Noon)"
  hour = rng.randint(1, 11)
  am = hour >= 8 and rng.random() < 0.5
  if r < 0.3:
    minute = rng.choice((15, 30, 45))
    return (f"at {hour}:{minute} {'am' if am else 'pm'}",
            f"(HourMinute{'Am' if am else 'Pm'} {hour}L {minute}L)")
  return (f"at {hour} {'am' if am else 'pm'}",
          f"(Number{'AM' if am else 'PM'} {hour}L)")


def _q(text: str) -> str:
  return json.dumps(text, ensure_ascii=False)


def _and(constraints: list[str]) -> str:
  """Left-nested conjunction, as SMCalFlow writes it: (& (& a b) c)."""
  out = constraints[0]
  for c in constraints[1:]:
    out = f"(& {out} {c})"
  return out


def _cap(s: str) -> str:
  return s[0].upper() + s[1:]


def _style(rng: random.Random, text: str) -> str:
  """Capitalisation and final punctuation vary as in typed input."""
  if rng.random() < 0.6:
    text = _cap(text)
  if rng.random() < 0.5:
    text += "?" if text.split()[0].lower() in (
        "what", "when", "who", "where", "is", "do", "does", "will", "how",
        "can", "are", "am", "any", "which", "what's") else "."
  return text


# ---------------------------------------------------------------------------
# SMCalFlow: each intent returns (utterance, lispress, agent reply).
# ---------------------------------------------------------------------------

_EMPTY_EVENT = "(^(Event) EmptyStructConstraint)"
_SALIENT_EVENT = f"(Execute (refer (extensionConstraint {_EMPTY_EVENT})))"
_ME = "(toRecipient (CurrentUser))"


def _person(name: str) -> str:
  return ("(Execute (refer (extensionConstraint (RecipientWithNameLike "
          f"(^(Recipient) EmptyStructConstraint) (PersonName.apply {_q(name)})))))")


def _find_events(constraint: str) -> str:
  return f"(QueryEventResponse.results (FindEventWrapperWithDefaults {constraint}))"


def _the_event(constraint: str) -> str:
  return f"(singleton {_find_events(constraint)})"


def _subject_like(subject: str) -> str:
  return f"(Event.subject_? (?~= {_q(subject)}))"


def _place(name: str) -> str:
  return f"(FindPlace (LocationKeyphrase.apply {_q(name)}))"


def _create_event(rng):
  subject = rng.choice(_SUBJECTS)
  (dtext, date), (ttext, time) = _date(rng), _time(rng)
  parts = [f"(Event.subject_? (?= {_q(subject)}))",
           f"(Event.start_? (?= (DateAtTimeWithDefaults {date} {time})))"]
  words = [rng.choice(("schedule", "add", "put", "create", "set up", "book")),
           rng.choice((f"a {subject}", f"{subject}", f"my {subject}")),
           dtext, ttext]
  extra = rng.random()
  if extra < 0.3:
    name = rng.choice(_FIRST)
    parts.append(f"(Event.attendees_? (AttendeeListHasRecipient {_person(name)}))")
    words.insert(2, f"with {name}")
  elif extra < 0.4:
    parts.append("(Event.attendees_? (AttendeeListHasRecipient "
                 f"(FindManager {_ME})))")
    words.insert(2, "with my manager")
  elif extra < 0.6:
    room = rng.choice(_ROOMS)
    parts.append(f"(Event.location_? (?= (LocationKeyphrase.apply {_q(room)})))")
    words.append(f"in {room}")
  elif extra < 0.75:
    if rng.random() < 0.5:
      hours = rng.randint(1, 3)
      parts.append(f"(Event.duration_? (?= (toHours {hours})))")
      words.append(f"for {hours} hour{'s' * (hours > 1)}")
    else:
      minutes = rng.choice((15, 30, 45))
      parts.append(f"(Event.duration_? (?= (toMinutes {minutes})))")
      words.append(f"for {minutes} minutes")
  if rng.random() < 0.3:
    words.insert(0, rng.choice(("please", "can you", "I need to", "could you")))
  program = ("(Yield (CreateCommitEventWrapper (CreatePreflightEventWrapper "
             f"{_and(parts)})))")
  reply = rng.choice(("Does this look right?", "Is this good?",
                      f"I can add {subject} to your calendar. Does this look right?"))
  return " ".join(words), program, reply


def _events_on_date(rng):
  dtext, date = _date(rng)
  if rng.random() < 0.6:
    text = rng.choice((f"what do I have {dtext}", f"what's on my calendar {dtext}",
                       f"show me my schedule {dtext}", f"am I busy {dtext}",
                       f"what meetings do I have {dtext}"))
    return text, f"(Yield (FindEventWrapperWithDefaults (EventOnDate {date} {_EMPTY_EVENT})))", \
        rng.choice(("Here is your schedule.", "I found these events.",
                    "You have a few things on your calendar."))
  subject = rng.choice(_SUBJECTS)
  text = rng.choice((f"when is my {subject} {dtext}", f"do I have {subject} {dtext}",
                     f"find the {subject} {dtext}"))
  return text, ("(Yield (FindEventWrapperWithDefaults (EventOnDate "
                f"{date} {_subject_like(subject)})))"), "I found this event."


def _event_detail(rng):
  subject = rng.choice(_SUBJECTS)
  field, texts = rng.choice((
      ("Event.start", (f"when is my {subject}", f"what time is the {subject}",
                       f"when does my {subject} start")),
      ("Event.end", (f"when does my {subject} end", f"what time is the {subject} over")),
      ("Event.attendees", (f"who is coming to the {subject}",
                           f"who is attending my {subject}")),
      ("Event.location", (f"where is my {subject}", f"where is the {subject} happening")),
  ))
  program = f"(Yield ({field} {_the_event(_subject_like(subject))}))"
  return rng.choice(texts), program, rng.choice(("Here it is.", "I found it."))


def _any_events(rng):
  text, range_ = rng.choice((("this weekend", "(ThisWeekend)"),
                             ("this week", "(ThisWeek)"),
                             ("next week", "(NextWeekList)")))
  utterance = rng.choice((f"do I have anything {text}", f"am I free {text}",
                          f"are there any events {text}"))
  program = (f"(Yield (> (size {_find_events(f'(EventDuringRange {_EMPTY_EVENT} {range_})')}) 0L))")
  return utterance, program, rng.choice(("Yes, you have events.", "No, you're free."))


def _weather(rng):
  dtext, date = _date(rng)
  if rng.random() < 0.5:
    town = rng.choice(_TOWNS)
    where, place = f"in {town}", f"(AtPlace {_place(town)})"
  else:
    where, place = "", "(AtPlace (Here))"
  query = f"(WeatherQueryApi {place} (DateTime.date_? (?= {date})))"
  form, texts = rng.choice((
      (query, ("what's the weather {w} {d}", "what is the weather like {d} {w}",
               "weather forecast {w} {d}")),
      (f"(IsRainy {query})", ("will it rain {d} {w}", "is it going to rain {w} {d}",
                              "do I need an umbrella {d} {w}")),
      (f"(IsCold {query})", ("will it be cold {w} {d}", "do I need a jacket {d} {w}")),
      (f"(WeatherAggregate (WeatherQuantifier.Max) (temperature) {query})",
       ("how hot will it get {d} {w}", "what's the high {w} {d}")),
      (f"(WeatherAggregate (WeatherQuantifier.Min) (temperature) {query})",
       ("how cold will it get {d} {w}", "what's the low {d} {w}")),
  ))
  text = " ".join(rng.choice(texts).format(w=where, d=dtext).split())
  return text, f"(Yield {form})", rng.choice(("Here is the forecast.",
                                               "It looks like a mild day."))


def _org_chart(rng):
  name = rng.choice(_FIRST)
  program, texts = rng.choice((
      (f"(FindManager {_person(name)})", (f"who is {name}'s manager",
                                          f"who does {name} report to")),
      (f"(FindManager {_ME})", ("who is my manager", "who's my boss")),
      (f"(FindReports {_ME})", ("who reports to me", "who is on my team")),
      (f"(FindTeamOf {_person(name)})", (f"who is on {name}'s team",
                                         f"show me {name}'s teammates")),
      (f"(FindReports {_person(name)})", (f"who reports to {name}",)),
  ))
  return rng.choice(texts), f"(Yield {program})", "Here is what I found."


def _places(rng):
  venue = rng.choice(_VENUES)
  feature, texts = rng.choice((
      ("(PlaceFeature.OutdoorDining)", ("does {v} have outdoor seating",
                                        "can we sit outside at {v}")),
      ("(PlaceFeature.FamilyFriendly)", ("is {v} good for kids",
                                         "is {v} family friendly")),
      ("(PlaceFeature.HappyHour)", ("does {v} have a happy hour",)),
      (None, ("what's the address of {v}", "where is {v}")),
  ))
  text = rng.choice(texts).format(v=venue)
  program = (f"(Yield (PlaceHasFeature {feature} {_place(venue)}))" if feature
             else f"(Yield (Place.formattedAddress {_place(venue)}))")
  return text, program, "Let me check."


def _delete_event(rng):
  subject = rng.choice(_SUBJECTS)
  if rng.random() < 0.5:
    dtext, date = _date(rng)
    constraint = f"(EventOnDate {date} {_subject_like(subject)})"
    text = rng.choice((f"cancel my {subject} {dtext}", f"delete the {subject} {dtext}"))
  else:
    constraint = _subject_like(subject)
    text = rng.choice((f"cancel my {subject}", f"remove the {subject} from my calendar"))
  program = ("(Yield (DeleteCommitEventWrapper (DeletePreflightEventWrapper "
             f"(Event.id {_the_event(constraint)}))))")
  return text, program, "Do you want me to delete this event?"


def _update_event(rng):
  subject = rng.choice(_SUBJECTS)
  if rng.random() < 0.5:
    ttext, time = _time(rng)
    change, text = (f"(Event.start_? (DateTime.time_? (?= {time})))",
                    rng.choice((f"move my {subject} to {ttext[3:]}",
                                f"push the {subject} to {ttext[3:]}")))
  else:
    dtext, date = _date(rng)
    change, text = (f"(Event.start_? (DateTime.date_? (?= {date})))",
                    f"reschedule my {subject} to {dtext.removeprefix('on ')}")
  program = ("(Yield (UpdateCommitEventWrapper (UpdatePreflightEventWrapper "
             f"(Event.id {_the_event(_subject_like(subject))}) {change})))")
  return text, program, "Is this the change you want?"


def _now_relative(rng):
  after = rng.random() < 0.6
  fn = "EventOnDateAfterTime" if after else "EventOnDateBeforeTime"
  text = rng.choice(("what's next on my calendar", "what do I have later today",
                     "what's left today") if after else
                    ("what did I have earlier today", "what meetings did I miss today"))
  program = (f"(let (x0 (Now)) (Yield (FindEventWrapperWithDefaults ({fn} "
             f"(DateTime.date x0) {_EMPTY_EVENT} (DateTime.time x0)))))")
  return text, program, "Here is what I found."


def _small_talk(rng):
  program, texts = rng.choice((
      ("(Yield (GenericPleasantry))", ("thanks", "thank you so much", "hello there")),
      ("(Yield (PleasantryAnythingElseCombined))", ("that's all for now",
                                                     "nothing else, thanks")),
      ("(FenceOther)", ("order me a pizza", "play some music",
                        f"book me a flight to {rng.choice(_TOWNS)}")),
      ("(FenceGibberish)", ("asdf", "blorp",)),
  ))
  return rng.choice(texts), program, rng.choice(("You're welcome!",
                                                 "Sorry, I can't help with that."))


_OUTPUT = '(refer (^(Dynamic) roleConstraint (Path.apply "output")))'


def _revise(rng):
  r = rng.random()
  if r < 0.35:
    ttext, time = _time(rng)
    change = f"(Event.start_? (DateTime.time_? (?= {time})))"
    text = rng.choice((f"make it {ttext} instead", f"actually {ttext[3:]}",
                       f"can you change it to {ttext[3:]}"))
  elif r < 0.6:
    dtext, date = _date(rng)
    change = f"(Event.start_? (DateTime.date_? (?= {date})))"
    text = rng.choice((f"make it {dtext} instead", f"move it to {dtext.removeprefix('on ')}"))
  elif r < 0.85:
    name = rng.choice(_FIRST)
    change = f"(Event.attendees_? (AttendeeListHasRecipient {_person(name)}))"
    text = rng.choice((f"add {name} to it", f"invite {name} too",
                       f"{name} {rng.choice(_LAST)} should come as well"))
  else:
    room = rng.choice(_ROOMS)
    change = f"(Event.location_? (?= (LocationKeyphrase.apply {_q(room)})))"
    text = f"put it in {room}"
  program = (f"(Yield (Execute (ReviseConstraint {_OUTPUT} "
             f"(^(Event) ConstraintTypeIntension) {change})))")
  return text, program, "How about this?"


def _confirm(rng):
  text = rng.choice(("yes", "yes please", "looks good", "perfect", "that works",
                     "ok do it"))
  return text, "(Yield (Execute (^(Dynamic) ConfirmAndReturnAction)))", \
      "Done. I've updated your calendar."


def _refer_event(rng):
  field, texts = rng.choice((
      ("Event.attendees", ("who else is coming to that", "who is going")),
      ("Event.end", ("when does it end", "what time is that over")),
      ("Event.location", ("where is that", "where is it")),
  ))
  return rng.choice(texts), f"(Yield ({field} {_SALIENT_EVENT}))", "Here you go."


_SMCALFLOW_OPENERS = (
    (_create_event, 24), (_events_on_date, 12), (_event_detail, 9),
    (_any_events, 4), (_weather, 6), (_org_chart, 8), (_places, 5),
    (_delete_event, 8), (_update_event, 7), (_now_relative, 4),
    (_small_talk, 4))
# Intent -> the follow-ups it invites (taken with probability 0.7).
_SMCALFLOW_FOLLOW_UPS = {
    _create_event: ((_revise, 5), (_confirm, 5)),
    _revise: ((_revise, 2), (_confirm, 5)),
    _events_on_date: ((_refer_event, 1),),
    _event_detail: ((_refer_event, 1),),
    _refer_event: ((_refer_event, 1),),
    _update_event: ((_confirm, 1),),
    _delete_event: ((_confirm, 1),),
}


def _weighted(rng, options):
  fns, weights = zip(*options)
  return rng.choices(fns, weights=weights)[0]


def _smcalflow_dialogue(rng) -> list[tuple[str, str, str, bool]]:
  """(utterance, lispress, agent reply, skip) of each turn."""
  turns = []
  intent = _weighted(rng, _SMCALFLOW_OPENERS)
  for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
    text, program, reply = intent(rng)
    turns.append((_style(rng, text), program, reply,
                  intent is _confirm and rng.random() < 0.3))
    follow_ups = _SMCALFLOW_FOLLOW_UPS.get(intent)
    intent = _weighted(rng, follow_ups if follow_ups and rng.random() < 0.7
                       else _SMCALFLOW_OPENERS)
  return turns


# ---------------------------------------------------------------------------
# TreeDST: (domain type, intent) -> (utterance, lispress, agent reply).
# ---------------------------------------------------------------------------


def _slot(domain: str, slot: str, value: str) -> str:
  return f"({domain}.{slot}_? {value})"


def _is(value: str) -> str:
  return f"(?= {value})"


def _loc(name: str) -> str:
  return f"(Location.name_? (?= {_q(name)}))"


def _focus(domain: str, slot: str, type_: str) -> str:
  return f"({domain}.{slot}_? (^({type_}) always))"


def _plan(domain: str, verb: str, constraint: str, focus: str | None = None) -> str:
  focus = f" :focus {focus}" if focus else ""
  return f"(plan (^({domain}) {verb}{focus} :object {constraint}))"


def _flight(rng):
  a, b = rng.sample(_TOWNS, 2)
  dtext, date = _date(rng)
  parts = [_slot("Flight", "origin", _loc(a)), _slot("Flight", "destination", _loc(b)),
           _slot("Flight", "departureDate", _is(date))]
  kind = "flight"
  if rng.random() < 0.3:
    parts.append(_slot("Flight", "numberOfStops", _is("0L")))
    kind = "nonstop flight"
  tail = f"from {a} to {b} {dtext}"
  if rng.random() < 0.2:
    cabin = rng.choice(("Business", "Economy", "First"))
    parts.append(_slot("Flight", "cabinClass", _is(f"(CabinClass.{cabin})")))
    tail += f" in {cabin.lower()} class"
  r = rng.random()
  if r < 0.45:
    verb, focus = "Find", None
    text = f"{rng.choice(('find me a', 'search for a', 'look up a'))} {kind} {tail}"
  elif r < 0.8:
    verb, focus = "Book", None
    text = f"{rng.choice(('book a', 'I need a', 'reserve a'))} {kind} {tail}"
  else:
    verb, focus = "Find", _focus("Flight", "departureTime", "Time")
    text = f"what time does the {kind} {tail} leave"
  return text, _plan("Flight", verb, _and(parts), focus), \
      rng.choice(("I found a few flights.", "Which flight would you like?"))


def _hotel(rng):
  town = rng.choice(_TOWNS)
  name = f"the {rng.choice(_LAST)} {rng.choice(('Inn', 'Hotel', 'Lodge', 'Suites'))}"
  r = rng.random()
  if r < 0.4:
    stars = rng.randint(3, 5)
    constraint = _and([_slot("Hotel", "location", _loc(town)),
                       _slot("Hotel", "starRating", f"(?>= {stars}L)")])
    return (rng.choice((f"find a hotel in {town} with at least {stars} stars",
                        f"any {stars} star hotels in {town}")),
            _plan("Hotel", "Find", constraint), "I found some hotels.")
  if r < 0.75:
    nights = rng.randint(1, 6)
    constraint = _and([_slot("Hotel", "hotelName", _is(_q(name))),
                       _slot("Hotel", "numberOfNights", _is(f"{nights}L"))])
    stay = f"{nights} night{'s' * (nights > 1)}"
    return (rng.choice((f"book {name} for {stay}",
                        f"reserve a room at {name} for {stay}")),
            _plan("Hotel", "Book", constraint), "Your room is reserved.")
  feature, what = rng.choice((("hasParking", "parking"), ("hasPool", "a pool"),
                              ("hasWifi", "wifi")))
  return (f"does {name} have {what}",
          _plan("Hotel", "Find", _slot("Hotel", "hotelName", _is(_q(name))),
                _focus("Hotel", feature, "Boolean")), "Let me check.")


def _restaurant(rng):
  town = rng.choice(_TOWNS)
  cuisine = rng.choice(("Italian", "Thai", "Mexican", "Indian", "French",
                        "Japanese", "Greek"))
  if rng.random() < 0.5:
    constraint = _and([_slot("Restaurant", "cuisine", _is(f"(Cuisine.{cuisine})")),
                       _slot("Restaurant", "location", _loc(town))])
    return (rng.choice((f"find a {cuisine.lower()} restaurant in {town}",
                        f"where can I get {cuisine.lower()} food in {town}")),
            _plan("Restaurant", "Find", constraint), "Here are some options.")
  venue = rng.choice(_VENUES)
  people = rng.randint(2, 8)
  ttext, time = _time(rng)
  constraint = _and([_slot("Restaurant", "restaurantName", _is(_q(venue))),
                     _slot("Restaurant", "partySize", _is(f"{people}L")),
                     _slot("Restaurant", "time", _is(time))])
  return (rng.choice((f"book a table for {people} at {venue} {ttext}",
                      f"reserve {venue} for {people} people {ttext}")),
          _plan("Restaurant", "Book", constraint), "Your table is booked.")


def _taxi(rng):
  a, b = rng.sample(_TOWNS + _VENUES, 2)
  ttext, time = _time(rng)
  parts = [_slot("Taxi", "pickupLocation", _loc(a)),
           _slot("Taxi", "dropoffLocation", _loc(b)),
           _slot("Taxi", "pickupTime", _is(time))]
  text = rng.choice((f"get me a taxi from {a} to {b} {ttext}",
                     f"I need a cab to {b} from {a} {ttext}"))
  if rng.random() < 0.25:
    parts.append(_slot("Taxi", "serviceType",
                       "(List.exists_? (?= (ServiceType.Executive)))"))
    text += " and make it an executive car"
  return text, _plan("Taxi", "Book", _and(parts)), "Your taxi is booked."


def _train(rng):
  a, b = rng.sample(_TOWNS, 2)
  dtext, date = _date(rng)
  constraint = _and([_slot("Train", "origin", _loc(a)), _slot("Train", "destination", _loc(b)),
                     _slot("Train", "departureDate", _is(date))])
  if rng.random() < 0.5:
    return (rng.choice((f"when is the next train from {a} to {b} {dtext}",
                        f"what time does the train to {b} leave {a} {dtext}")),
            _plan("Train", "Find", constraint, _focus("Train", "departureTime", "Time")),
            "The next train leaves soon.")
  return (f"book a train ticket from {a} to {b} {dtext}",
          _plan("Train", "Book", constraint), "Your ticket is booked.")


def _attraction(rng):
  town = rng.choice(_TOWNS)
  kind = rng.choice(("museum", "park", "gallery", "zoo", "castle", "garden"))
  if rng.random() < 0.6:
    constraint = _and([_slot("Attraction", "category", _is(_q(kind))),
                       _slot("Attraction", "location", _loc(town))])
    return (rng.choice((f"what {kind}s are there in {town}",
                        f"find a {kind} to visit in {town}")),
            _plan("Attraction", "Find", constraint), "Here are a few.")
  name = f"the {rng.choice(_LAST)} {kind.title()}"
  day = rng.choice(_DAYS)
  return (f"is {name} open on {day}",
          _plan("Attraction", "Find",
                _and([_slot("Attraction", "attractionName", _is(_q(name))),
                      _slot("Attraction", "openDay", _is(f"({day})"))]),
                _focus("Attraction", "isOpen", "Boolean")), "Let me look.")


def _message(rng):
  name = rng.choice(_FIRST)
  body = rng.choice(("I'm running late", "see you at the station",
                     "can you call me back", "dinner is at seven",
                     "don't forget the tickets", "happy birthday"))
  if rng.random() < 0.8:
    constraint = _and([_slot("Message", "recipients", f"(Contact.name_? (?= {_q(name)}))"),
                       _slot("Message", "textContent", _is(_q(body)))])
    return (rng.choice((f"text {name} that {body}", f"send a message to {name} saying {body}",
                        f"tell {name} {body}")),
            _plan("Message", "Create", constraint), "Should I send it?")
  return (f"read my last message from {name}",
          _plan("Message", "Find", _slot("Message", "sender", f"(Contact.name_? (?= {_q(name)}))"),
                _focus("Message", "textContent", "String")), "Here it is.")


def _reminder(rng):
  task = rng.choice(("call the plumber", "water the plants", "pay rent",
                     "pick up the laundry", "buy milk", "renew my passport"))
  if rng.random() < 0.75:
    (dtext, date), (ttext, time) = _date(rng), _time(rng)
    constraint = _and([_slot("Reminder", "content", _is(_q(task))),
                       _slot("Reminder", "dateTime",
                             _is(f"(DateAtTimeWithDefaults {date} {time})"))])
    return (rng.choice((f"remind me to {task} {dtext} {ttext}",
                        f"set a reminder to {task} {dtext} {ttext}")),
            _plan("Reminder", "Create", constraint), "Reminder set.")
  return (f"delete my reminder to {task}",
          _plan("Reminder", "Delete", _slot("Reminder", "content", _is(_q(task)))),
          "Reminder deleted.")


def _navigation(rng):
  place = rng.choice(_TOWNS + _VENUES)
  mode, phrase = rng.choice((("Driving", "drive"), ("Walking", "walk"),
                             ("Transit", "take the bus")))
  constraint = _and([_slot("Navigation", "destination", _loc(place)),
                     _slot("Navigation", "travelMode", _is(f"(TravelMode.{mode})"))])
  if rng.random() < 0.5:
    return (f"how long will it take to {phrase} to {place}",
            _plan("Navigation", "Find", constraint,
                  _focus("Navigation", "duration", "Duration")), "About twenty minutes.")
  return (f"give me directions to {place}, I want to {phrase}",
          _plan("Navigation", "Find", constraint), "Starting directions.")


def _tdst_weather(rng):
  town = rng.choice(_TOWNS)
  dtext, date = _date(rng)
  constraint = _and([_slot("Weather", "location", _loc(town)),
                     _slot("Weather", "date", _is(date))])
  slot, type_, texts = rng.choice((
      ("temperature", "Temperature", ("how warm will it be in {t} {d}",
                                      "what's the temperature in {t} {d}")),
      ("willRain", "Boolean", ("will it rain in {t} {d}", "is rain expected in {t} {d}")),
      ("summary", "String", ("what's the weather in {t} {d}",)),
  ))
  return (rng.choice(texts).format(t=town, d=dtext),
          _plan("Weather", "Find", constraint, _focus("Weather", slot, type_)),
          "Here's the forecast.")


_TREEDST_OPENERS = {
    "Flight": _flight, "Hotel": _hotel, "Restaurant": _restaurant, "Taxi": _taxi,
    "Train": _train, "Attraction": _attraction, "Message": _message,
    "Reminder": _reminder, "Navigation": _navigation, "Weather": _tdst_weather,
}
_TREEDST_WEIGHTS = {"Flight": 14, "Hotel": 13, "Restaurant": 13, "Taxi": 10,
                    "Train": 8, "Attraction": 7, "Message": 11, "Reminder": 10,
                    "Navigation": 8, "Weather": 6}
_REVISABLE = ("Flight", "Hotel", "Restaurant", "Taxi", "Reminder")


def _revise_tdst(rng, domain):
  """A follow-up that changes one slot of the domain's pending request."""
  verb = "Create" if domain == "Reminder" else "Book"
  if domain == "Flight":
    dtext, date = _date(rng)
    text = f"actually make it {dtext.removeprefix('on ')}"
    change = _slot("Flight", "departureDate", _is(date))
  elif domain == "Hotel":
    nights = rng.randint(1, 6)
    text = f"change it to {nights} night{'s' * (nights > 1)}"
    change = _slot("Hotel", "numberOfNights", _is(f"{nights}L"))
  elif domain == "Restaurant":
    people = rng.randint(2, 8)
    text = f"make that a table for {people}"
    change = _slot("Restaurant", "partySize", _is(f"{people}L"))
  elif domain == "Taxi":
    text = "I'd like an executive car instead"
    change = _slot("Taxi", "serviceType",
                   "(List.exists_? (?= (ServiceType.Executive)))")
  else:  # Reminder
    ttext, time = _time(rng)
    text = f"make it {ttext} instead"
    change = _slot("Reminder", "dateTime", f"(DateTime.time_? (?= {time}))")
  program = (f'(plan (revise (^(Unit) Path.apply "{verb}") '
             f'(^((Constraint {domain})) Path.apply "object") '
             f"(lambda (^(Constraint {domain}) x0) (& x0 {change}))))")
  return text, program, "I've updated it."


def _confirm_tdst(rng, domain):
  return (rng.choice(("yes", "yes please", "sounds good", "go ahead")),
          f"(plan (^({domain}) Confirm :object (refer (^({domain}) extensionConstraint))))",
          "Done.")


def _close_tdst(rng):
  return (rng.choice(("thanks, that's all", "no that's it", "thank you")),
          "(plan (^(Unit) EndConversation))", "Goodbye!")


def _treedst_dialogue(rng) -> list[tuple[str, str, str, bool]]:
  """(utterance, lispress, agent reply, skip) of each turn."""
  turns = []
  domain = _weighted(rng, list(_TREEDST_WEIGHTS.items()))
  pending = False  # a Book/Create request the user may revise or confirm
  for _ in range(rng.choice((1, 2, 2, 3, 3, 4))):
    r, skip, close = rng.random(), False, False
    if pending and domain in _REVISABLE and r < 0.35:
      text, program, reply = _revise_tdst(rng, domain)
    elif pending and r < 0.7:
      text, program, reply = _confirm_tdst(rng, domain)
      skip, pending = rng.random() < 0.3, False
    elif turns and r > 0.9:
      (text, program, reply), close = _close_tdst(rng), True
    else:
      if turns and rng.random() < 0.5:  # switch domain mid-dialogue
        domain = _weighted(rng, list(_TREEDST_WEIGHTS.items()))
      text, program, reply = _TREEDST_OPENERS[domain](rng)
      pending = re.match(r"\(plan \(\^\(\w+\) (Book|Create) ", program) is not None
    turns.append((_style(rng, " ".join(text.split())), program, reply, skip))
    if close:
      break
  return turns


# ---------------------------------------------------------------------------
# Files.
# ---------------------------------------------------------------------------


def _dialogue_id(rng: random.Random) -> str:
  h = f"{rng.getrandbits(128):032x}"
  return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _dialogue_json(dialogue_id: str, turns) -> str:
  out = []
  for index, (text, program, reply, skip) in enumerate(turns):
    canonical = lispress.render(program)
    if canonical != program:  # the generator must write canonical Lispress
      raise AssertionError(f"non-canonical program {program!r}")
    out.append({
        "turn_index": index,
        "user_utterance": {"original_text": text, "tokens": _tokens(text)},
        "agent_utterance": {"original_text": reply, "tokens": _tokens(reply),
                            "described_entities": []},
        "lispress": program,
        "skip": skip,
        "program_execution_oracle": {"has_exception": False,
                                     "refer_are_correct": True},
    })
  return json.dumps({"dialogue_id": dialogue_id, "turns": out},
                    ensure_ascii=False, separators=(",", ":"))


def build(dataset: str, file_split: str) -> list[str]:
  """The JSONL lines of one file."""
  rng = random.Random(SEEDS[(dataset, file_split)])
  make = _smcalflow_dialogue if dataset == "smcalflow" else _treedst_dialogue
  return [_dialogue_json(_dialogue_id(rng), make(rng))
          for _ in range(NUM_DIALOGUES[file_split])]


def _write_lines(path: str, lines) -> None:
  with open(path, "w", encoding="utf-8", newline="\n") as f:
    for line in lines:
      f.write(line + "\n")


def _task_texts(turns: list[semparse.Turn]) -> tuple[list[str], list[str]]:
  """(GPT-2 task texts, T5 parser texts) of the train turns, in order."""
  gpt2, t5 = [], []
  for t in turns:
    gpt2 += [t.utterance, t.program, semparse_tasks.parse_prompt(t.program)]
    if t.domain is not None:
      gpt2.append(semparse_tasks.domain_prompt(t.domain))
    t5 += [t.utterance, t.program]
  return gpt2, t5


def train_bpe(texts: list[str], output_dir: str,
              vocab_size: int = BPE_VOCAB_SIZE) -> None:
  """GPT-2-format vocab.json + merges.txt; `<|endoftext|>` gets the last id."""
  from tokenizers import ByteLevelBPETokenizer  # pylint: disable=g-import-not-at-top

  tok = ByteLevelBPETokenizer()  # add_prefix_space=False, like GPT-2
  tok.train_from_iterator(texts, vocab_size=vocab_size - 1, min_frequency=2,
                          show_progress=False)
  tok.save_model(output_dir)
  path = os.path.join(output_dir, "vocab.json")
  with open(path, encoding="utf-8") as f:
    vocab = json.load(f)
  vocab[EOS_TOKEN] = len(vocab)
  with open(path, "w", encoding="utf-8", newline="\n") as f:
    json.dump(vocab, f, ensure_ascii=False)


def train_sentencepiece(texts: list[str], model_prefix: str,
                        vocab_size: int = SPM_VOCAB_SIZE) -> None:
  """A T5-style (pad 0, eos 1, unk 2, no bos) unigram model.

  T5's NFKC normalization (the identity on ASCII) but no whitespace folding,
  so that every (ASCII) task text decodes to exactly itself.
  """
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top

  spm.set_random_generator_seed(SPM_SEED)
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_prefix=model_prefix,
      model_type="unigram", vocab_size=vocab_size, character_coverage=1.0,
      normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=False,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1, num_threads=1,
      input_sentence_size=0, shuffle_input_sentence=False,
      max_sentence_length=8192, minloglevel=2)
  # The proto records the output path; keep the base name only so the bytes
  # do not depend on where the sample was generated.
  model_file = model_prefix + ".model"
  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_file, "rb") as f:
    proto.ParseFromString(f.read())
  proto.trainer_spec.model_prefix = os.path.basename(model_prefix)
  with open(model_file, "wb") as f:
    f.write(proto.SerializeToString(deterministic=True))


def _dataset_readme(dataset: str, splits: dict[str, list[semparse.Turn]],
                    lines: dict[str, list[str]]) -> str:
  rows = [f"# {DIRS[dataset]}", "",
          f"A fictional {'SMCalFlow 2.0' if dataset == 'smcalflow' else 'TreeDST'}"
          "-format sample generated by",
          "`python -m tasks.semparse_sample.generate` (deterministic; do not edit",
          "by hand), in the published dataflow-dialogue JSONL format. Examples",
          "are the human turns with `skip` false (`tasks.semparse.load_turns`).",
          "", "| statistic | value |", "| --- | --- |"]
  for split, turns in splits.items():
    dialogues = [json.loads(x) for x in lines[split]]
    all_turns = sum(len(d["turns"]) for d in dialogues)
    rows.append(f"| {split}: dialogues / turns / examples (skip false) | "
                f"{len(dialogues)} / {all_turns} / {len(turns)} |")
  train = splits["train"]
  types = collections.Counter(f for t in train for f in t.function_types)
  rows.append(f"| train: distinct function types | {len(types)} |")
  if dataset == "smcalflow":
    for name, patterns in semparse.PAPER_EXCLUSIONS.items():
      n = len(train) - len(semparse.drop_functions(train, patterns))
      rows.append(f"| train: examples calling {' or '.join(f'`{p}`' for p in patterns)}"
                  f" ({name}) | {n} |")
  else:
    domains = collections.Counter(t.domain for t in train)
    rows.append("| train: examples per domain | " + ", ".join(
        f"{d} {n}" for d, n in sorted(domains.items())) + " |")
  rows.append("| train: top function types | " + ", ".join(
      f"`{f}` {n}" for f, n in types.most_common(12)) + " |")
  return "\n".join(rows) + "\n"


def _vocab_readme(gpt2_texts, t5_texts, output_dir) -> str:
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from tokenizers import ByteLevelBPETokenizer  # pylint: disable=g-import-not-at-top

  bpe = ByteLevelBPETokenizer(os.path.join(output_dir, "vocab.json"),
                              os.path.join(output_dir, "merges.txt"))
  sp = spm.SentencePieceProcessor(
      model_file=os.path.join(output_dir, SPM_MODEL_NAME + ".model"))
  bpe_lens = [len(e.ids) for e in bpe.encode_batch(gpt2_texts)]
  sp_lens = [len(x) for x in sp.encode(t5_texts)]
  return "\n".join([
      "# semparse_vocab", "",
      "Vocabularies of the embedded SMCalFlow/TreeDST samples, trained by",
      "`python -m tasks.semparse_sample.generate` on the train splits' task",
      "texts (utterances, linearized programs and prompts):", "",
      f"* `vocab.json` + `merges.txt`: GPT-2-format byte-level BPE, "
      f"{bpe.get_vocab_size()} tokens (the 256 bytes first, `{EOS_TOKEN}` last = EOS).",
      f"* `{SPM_MODEL_NAME}.model` / `.vocab`: SentencePiece unigram, "
      f"{SPM_VOCAB_SIZE} pieces; pad 0, eos 1, unk 2, no bos (T5's ids);",
      "  NFKC without whitespace folding, so ASCII texts decode exactly.", "",
      "| statistic | value |", "| --- | --- |",
      f"| GPT-2 task texts: BPE tokens mean / max | "
      f"{sum(bpe_lens) / len(bpe_lens):.1f} / {max(bpe_lens)} |",
      f"| parser texts: SentencePiece tokens mean / max | "
      f"{sum(sp_lens) / len(sp_lens):.1f} / {max(sp_lens)} |",
  ]) + "\n"


def generate(output_dir: str = DEFAULT_OUTPUT_DIR, *,
             train_vocabularies: bool = True) -> dict:
  """Writes both samples (and the vocabularies) under `output_dir`.

  Returns {dataset: {seqio split: [Turn]}} as read back by `tasks.semparse`.
  """
  loaded = {}
  gpt2_texts, t5_texts = [], []
  for dataset in semparse.DATASETS:
    directory = os.path.join(output_dir, DIRS[dataset])
    os.makedirs(directory, exist_ok=True)
    lines = {}
    for split, file_split in FILE_SPLITS.items():
      lines[split] = build(dataset, file_split)
      _write_lines(os.path.join(directory, semparse.SPLIT_FILES[split]),
                   lines[split])
    loaded[dataset] = {split: semparse.load_turns(dataset, split, directory)
                       for split in FILE_SPLITS}
    gpt2, t5 = _task_texts(loaded[dataset]["train"])
    gpt2_texts += gpt2
    t5_texts += t5
    with open(os.path.join(directory, "README.md"), "w", encoding="utf-8",
              newline="\n") as f:
      f.write(_dataset_readme(dataset, loaded[dataset], lines))
  if train_vocabularies:
    vocab_dir = os.path.join(output_dir, DIRS["vocab"])
    os.makedirs(vocab_dir, exist_ok=True)
    train_bpe(gpt2_texts, vocab_dir)
    # Every printable ASCII character once, so none is ever <unk>.
    train_sentencepiece(t5_texts + [" ".join(string.printable[:94])],
                        os.path.join(vocab_dir, SPM_MODEL_NAME))
    with open(os.path.join(vocab_dir, "README.md"), "w", encoding="utf-8",
              newline="\n") as f:
      f.write(_vocab_readme(gpt2_texts, t5_texts, vocab_dir))
  return loaded


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR)
  parser.add_argument("--no_vocab", action="store_true",
                      help="skip training the BPE and SentencePiece vocabularies")
  args = parser.parse_args(argv)
  generate(args.output_dir, train_vocabularies=not args.no_vocab)
  for name in DIRS.values():
    path = os.path.join(args.output_dir, name, "README.md")
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        print(f.read())


if __name__ == "__main__":
  main()
