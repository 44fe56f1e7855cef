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

With ``--public_corpus`` it writes instead the public pretraining corpus
``semparse_public/{train,validation}.jsonl`` (+ ``README.md``;
`generate_public_corpus`): the same intents and templates filled from
``PUBLIC_POOLS``, entity pools disjoint from the sample's ``SAMPLE_POOLS``,
one ``{"text": ...}`` document per turn as the GPT-2 tasks render it.

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
import dataclasses
import json
import os
import random
import re
import string

from dpjax.data.readers import semparse, text_corpus
from dpjax.data.text import lispress
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


@dataclasses.dataclass(frozen=True)
class EntityPools:
  """The named entities the intents fill their slots with: everything in an
  utterance or a program's string literals that is not the world's language
  (templates, function names, dates, times, numbers, cuisines, cabin classes)."""
  first: tuple[str, ...]  # person first names
  last: tuple[str, ...]  # last names (people, hotel and attraction names)
  towns: tuple[str, ...]
  venues: tuple[str, ...]  # restaurants / cafes
  rooms: tuple[str, ...]  # event locations
  subjects: tuple[str, ...]  # event subjects
  messages: tuple[str, ...]  # TreeDST message bodies
  reminders: tuple[str, ...]  # TreeDST reminder contents
  attractions: tuple[str, ...]  # attraction categories (lower case)
  lodgings: tuple[str, ...]  # hotel name suffixes ("the <Last> <Lodging>")


# The private sample's entities.
SAMPLE_POOLS = EntityPools(
    first=_FIRST, last=_LAST, towns=_TOWNS, venues=_VENUES, rooms=_ROOMS,
    subjects=_SUBJECTS,
    messages=("I'm running late", "see you at the station",
              "can you call me back", "dinner is at seven",
              "don't forget the tickets", "happy birthday"),
    reminders=("call the plumber", "water the plants", "pay rent",
               "pick up the laundry", "buy milk", "renew my passport"),
    attractions=("museum", "park", "gallery", "zoo", "castle", "garden"),
    lodgings=("Inn", "Hotel", "Lodge", "Suites"))

# The public pretraining corpus's entities: disjoint from SAMPLE_POOLS (no
# entity, and no capitalised word of one, in common; `_check_disjoint`).
PUBLIC_POOLS = EntityPools(
    first=("Amara", "Bastian", "Celeste", "Dorian", "Elowen", "Felix", "Greta",
           "Halden", "Imogen", "Jasper", "Kalina", "Leander", "Marisol",
           "Nerys", "Osric", "Perrin", "Rowena", "Silas", "Thea", "Ursula",
           "Valen", "Wilhelmina", "Xander", "Yvette", "Zephyr", "Anselm",
           "Brielle", "Cosmo", "Delphine", "Evander", "Fiora", "Gideon",
           "Hollis", "Isolde", "Jules", "Linnea", "Magnus", "Odessa", "Quentin",
           "Renata"),
    last=("Ashgrove", "Blackwood", "Carraway", "Dunstan", "Everly", "Fairbanks",
          "Greaves", "Holloway", "Ingram", "Jellicoe", "Kingsley", "Lockhart",
          "Mayfield", "Ormsby", "Prescott", "Quimby", "Radcliffe", "Stanhope",
          "Thackeray", "Underhill", "Vickers", "Whitlock", "Yardley",
          "Ainsworth", "Beaumont", "Rutherford", "Sinclair", "Tolliver",
          "Wainwright", "Marchbanks"),
    towns=("Ashcombe", "Bellhaven", "Crowmarsh", "Dovercliff", "Eastwold",
           "Foxley Green", "Greywater", "Hazelmoor", "Ironvale", "Jadeport",
           "Kingsreach", "Lindenfield", "Nettlebury", "Pinecrest",
           "Queensferry", "Ravenmoor", "Saltmarsh", "Tallowbridge",
           "Umberfield", "Valewood", "Westerby", "Yarrowdale", "Zennor Cove",
           "Starling Heights", "Harrow Cross", "Silverlake", "Cedar Hollow",
           "Wickham Vale"),
    venues=("the Silver Spoon", "Cedar Kitchen", "the Painted Door",
            "Harbor Lights Diner", "the Rusty Anchor", "Olive and Thyme",
            "the Golden Pear", "Peppercorn Eatery", "the Velvet Lamp",
            "Sunflower Canteen", "Driftwood Brasserie", "the Amber Teapot",
            "Mossy Stone Pub", "Clover Tearoom", "the Stag and Hound",
            "Plum Tree Trattoria", "the Iron Skillet", "Seaglass Noodle Bar"),
    rooms=("the lounge", "huddle space 2", "the main hall", "the rooftop deck",
           "studio C", "the training center", "the lobby", "the break area",
           "the east wing", "the quiet corner", "meeting pod 9"),
    subjects=("board meeting", "brunch", "tennis match", "guitar lesson",
              "all hands", "performance review", "sales call", "client demo",
              "doctor visit", "swim class", "chess club", "planning session",
              "marketing sync", "onboarding session", "hiring committee",
              "workshop", "band rehearsal", "physical therapy", "eye exam",
              "car service", "status update", "strategy meeting",
              "product launch", "mentoring session", "tax appointment",
              "breakfast", "running club", "karate practice", "cooking class",
              "language exchange", "staff meeting", "hackathon",
              "board game night", "family visit", "birthday party",
              "volunteer shift"),
    messages=("I'm on my way", "see you soon", "I left the keys at home",
              "please bring snacks", "the train is delayed", "congratulations",
              "I'll be there in ten minutes", "good luck today",
              "let's meet at the entrance", "call me when you land",
              "traffic is terrible"),
    reminders=("feed the cat", "take out the trash", "charge my phone",
               "send the invoice", "pick up groceries", "walk the dog",
               "back up my laptop", "change the air filter", "sign the lease",
               "book an oil change"),
    attractions=("aquarium", "cathedral", "lighthouse", "observatory",
                 "theater", "market", "monument", "planetarium"),
    lodgings=("Resort", "Manor", "Retreat", "Towers"))


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


def _create_event(rng, p: EntityPools):
  subject = rng.choice(p.subjects)
  (dtext, date), (ttext, time) = _date(rng), _time(rng)
  parts = [f"(Event.subject_? (?= {_q(subject)}))",
           f"(Event.start_? (?= (DateAtTimeWithDefaults {date} {time})))"]
  words = [rng.choice(("schedule", "add", "put", "create", "set up", "book")),
           rng.choice((f"a {subject}", f"{subject}", f"my {subject}")),
           dtext, ttext]
  extra = rng.random()
  if extra < 0.3:
    name = rng.choice(p.first)
    parts.append(f"(Event.attendees_? (AttendeeListHasRecipient {_person(name)}))")
    words.insert(2, f"with {name}")
  elif extra < 0.4:
    parts.append("(Event.attendees_? (AttendeeListHasRecipient "
                 f"(FindManager {_ME})))")
    words.insert(2, "with my manager")
  elif extra < 0.6:
    room = rng.choice(p.rooms)
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


def _events_on_date(rng, p: EntityPools):
  dtext, date = _date(rng)
  if rng.random() < 0.6:
    text = rng.choice((f"what do I have {dtext}", f"what's on my calendar {dtext}",
                       f"show me my schedule {dtext}", f"am I busy {dtext}",
                       f"what meetings do I have {dtext}"))
    return text, f"(Yield (FindEventWrapperWithDefaults (EventOnDate {date} {_EMPTY_EVENT})))", \
        rng.choice(("Here is your schedule.", "I found these events.",
                    "You have a few things on your calendar."))
  subject = rng.choice(p.subjects)
  text = rng.choice((f"when is my {subject} {dtext}", f"do I have {subject} {dtext}",
                     f"find the {subject} {dtext}"))
  return text, ("(Yield (FindEventWrapperWithDefaults (EventOnDate "
                f"{date} {_subject_like(subject)})))"), "I found this event."


def _event_detail(rng, p: EntityPools):
  subject = rng.choice(p.subjects)
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


def _any_events(rng, p: EntityPools):
  text, range_ = rng.choice((("this weekend", "(ThisWeekend)"),
                             ("this week", "(ThisWeek)"),
                             ("next week", "(NextWeekList)")))
  utterance = rng.choice((f"do I have anything {text}", f"am I free {text}",
                          f"are there any events {text}"))
  program = (f"(Yield (> (size {_find_events(f'(EventDuringRange {_EMPTY_EVENT} {range_})')}) 0L))")
  return utterance, program, rng.choice(("Yes, you have events.", "No, you're free."))


def _weather(rng, p: EntityPools):
  dtext, date = _date(rng)
  if rng.random() < 0.5:
    town = rng.choice(p.towns)
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


def _org_chart(rng, p: EntityPools):
  name = rng.choice(p.first)
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


def _places(rng, p: EntityPools):
  venue = rng.choice(p.venues)
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


def _delete_event(rng, p: EntityPools):
  subject = rng.choice(p.subjects)
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


def _update_event(rng, p: EntityPools):
  subject = rng.choice(p.subjects)
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


def _now_relative(rng, p: EntityPools):
  after = rng.random() < 0.6
  fn = "EventOnDateAfterTime" if after else "EventOnDateBeforeTime"
  text = rng.choice(("what's next on my calendar", "what do I have later today",
                     "what's left today") if after else
                    ("what did I have earlier today", "what meetings did I miss today"))
  program = (f"(let (x0 (Now)) (Yield (FindEventWrapperWithDefaults ({fn} "
             f"(DateTime.date x0) {_EMPTY_EVENT} (DateTime.time x0)))))")
  return text, program, "Here is what I found."


def _small_talk(rng, p: EntityPools):
  program, texts = rng.choice((
      ("(Yield (GenericPleasantry))", ("thanks", "thank you so much", "hello there")),
      ("(Yield (PleasantryAnythingElseCombined))", ("that's all for now",
                                                     "nothing else, thanks")),
      ("(FenceOther)", ("order me a pizza", "play some music",
                        f"book me a flight to {rng.choice(p.towns)}")),
      ("(FenceGibberish)", ("asdf", "blorp",)),
  ))
  return rng.choice(texts), program, rng.choice(("You're welcome!",
                                                 "Sorry, I can't help with that."))


_OUTPUT = '(refer (^(Dynamic) roleConstraint (Path.apply "output")))'


def _revise(rng, p: EntityPools):
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
    name = rng.choice(p.first)
    change = f"(Event.attendees_? (AttendeeListHasRecipient {_person(name)}))"
    text = rng.choice((f"add {name} to it", f"invite {name} too",
                       f"{name} {rng.choice(p.last)} should come as well"))
  else:
    room = rng.choice(p.rooms)
    change = f"(Event.location_? (?= (LocationKeyphrase.apply {_q(room)})))"
    text = f"put it in {room}"
  program = (f"(Yield (Execute (ReviseConstraint {_OUTPUT} "
             f"(^(Event) ConstraintTypeIntension) {change})))")
  return text, program, "How about this?"


def _confirm(rng, p: EntityPools):
  text = rng.choice(("yes", "yes please", "looks good", "perfect", "that works",
                     "ok do it"))
  return text, "(Yield (Execute (^(Dynamic) ConfirmAndReturnAction)))", \
      "Done. I've updated your calendar."


def _refer_event(rng, p: EntityPools):
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


def _smcalflow_dialogue(rng, p: EntityPools) -> list[tuple[str, str, str, bool]]:
  """(utterance, lispress, agent reply, skip) of each turn."""
  turns = []
  intent = _weighted(rng, _SMCALFLOW_OPENERS)
  for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
    text, program, reply = intent(rng, p)
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


def _flight(rng, p: EntityPools):
  a, b = rng.sample(p.towns, 2)
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


def _hotel(rng, p: EntityPools):
  town = rng.choice(p.towns)
  name = f"the {rng.choice(p.last)} {rng.choice(p.lodgings)}"
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


def _restaurant(rng, p: EntityPools):
  town = rng.choice(p.towns)
  cuisine = rng.choice(("Italian", "Thai", "Mexican", "Indian", "French",
                        "Japanese", "Greek"))
  if rng.random() < 0.5:
    constraint = _and([_slot("Restaurant", "cuisine", _is(f"(Cuisine.{cuisine})")),
                       _slot("Restaurant", "location", _loc(town))])
    return (rng.choice((f"find a {cuisine.lower()} restaurant in {town}",
                        f"where can I get {cuisine.lower()} food in {town}")),
            _plan("Restaurant", "Find", constraint), "Here are some options.")
  venue = rng.choice(p.venues)
  people = rng.randint(2, 8)
  ttext, time = _time(rng)
  constraint = _and([_slot("Restaurant", "restaurantName", _is(_q(venue))),
                     _slot("Restaurant", "partySize", _is(f"{people}L")),
                     _slot("Restaurant", "time", _is(time))])
  return (rng.choice((f"book a table for {people} at {venue} {ttext}",
                      f"reserve {venue} for {people} people {ttext}")),
          _plan("Restaurant", "Book", constraint), "Your table is booked.")


def _taxi(rng, p: EntityPools):
  a, b = rng.sample(p.towns + p.venues, 2)
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


def _train(rng, p: EntityPools):
  a, b = rng.sample(p.towns, 2)
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


def _attraction(rng, p: EntityPools):
  town = rng.choice(p.towns)
  kind = rng.choice(p.attractions)
  if rng.random() < 0.6:
    constraint = _and([_slot("Attraction", "category", _is(_q(kind))),
                       _slot("Attraction", "location", _loc(town))])
    return (rng.choice((f"what {kind}s are there in {town}",
                        f"find a {kind} to visit in {town}")),
            _plan("Attraction", "Find", constraint), "Here are a few.")
  name = f"the {rng.choice(p.last)} {kind.title()}"
  day = rng.choice(_DAYS)
  return (f"is {name} open on {day}",
          _plan("Attraction", "Find",
                _and([_slot("Attraction", "attractionName", _is(_q(name))),
                      _slot("Attraction", "openDay", _is(f"({day})"))]),
                _focus("Attraction", "isOpen", "Boolean")), "Let me look.")


def _message(rng, p: EntityPools):
  name = rng.choice(p.first)
  body = rng.choice(p.messages)
  if rng.random() < 0.8:
    constraint = _and([_slot("Message", "recipients", f"(Contact.name_? (?= {_q(name)}))"),
                       _slot("Message", "textContent", _is(_q(body)))])
    return (rng.choice((f"text {name} that {body}", f"send a message to {name} saying {body}",
                        f"tell {name} {body}")),
            _plan("Message", "Create", constraint), "Should I send it?")
  return (f"read my last message from {name}",
          _plan("Message", "Find", _slot("Message", "sender", f"(Contact.name_? (?= {_q(name)}))"),
                _focus("Message", "textContent", "String")), "Here it is.")


def _reminder(rng, p: EntityPools):
  task = rng.choice(p.reminders)
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


def _navigation(rng, p: EntityPools):
  place = rng.choice(p.towns + p.venues)
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


def _tdst_weather(rng, p: EntityPools):
  town = rng.choice(p.towns)
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


def _treedst_dialogue(rng, p: EntityPools) -> list[tuple[str, str, str, bool]]:
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
      text, program, reply = _TREEDST_OPENERS[domain](rng, p)
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
  return [_dialogue_json(_dialogue_id(rng), make(rng, SAMPLE_POOLS))
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


# ---------------------------------------------------------------------------
# Public pretraining corpus.
# ---------------------------------------------------------------------------

PUBLIC_SEED = 5101  # the sample's files use 3101-3102 and 4101-4102
DEFAULT_PUBLIC_DIR = os.path.join(DEFAULT_OUTPUT_DIR, "semparse_public")
PUBLIC_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}
# Dialogues per dataset (SMCalFlow and TreeDST alike); validation keeps only
# the documents that are not in train.
PUBLIC_NUM_DIALOGUES = {"train": 1100, "validation": 80}
# TreeDST turns rendered with the 1.5-stage domain prompt instead of the parse.
PUBLIC_DOMAIN_PROMPT_FRACTION = 0.2
_PUBLIC_SEED_OFFSETS = {("smcalflow", "train"): 0, ("treedst", "train"): 1,
                        ("smcalflow", "validation"): 2,
                        ("treedst", "validation"): 3}


def _capitalised_words(text: str) -> list[str]:
  return re.findall(r"\b[A-Z][a-z]+\b", text)


def _check_disjoint(sample: EntityPools, public: EntityPools) -> None:
  """Raises unless no entity of one pool set occurs (case-insensitively, as
  whole words) inside an entity of the other, and no capitalised word (a
  name) is shared."""
  def entities(pools):
    return [e for f in dataclasses.fields(pools) for e in getattr(pools, f.name)]
  a, b = entities(sample), entities(public)
  for x, y in [(x, y) for x in a for y in b] + [(y, x) for x in a for y in b]:
    if re.search(r"\b" + re.escape(x.lower()) + r"\b", y.lower()):
      raise AssertionError(f"entity {x!r} occurs in {y!r}")
  shared = sorted(set(_capitalised_words(" ".join(a)))
                  & set(_capitalised_words(" ".join(b))))
  if shared:
    raise AssertionError(f"sample and public entities share names {shared}")


def public_documents(dataset: str, split: str, seed: int = PUBLIC_SEED
                     ) -> list[str]:
  """The documents of `dataset`'s dialogues for one public split, in order.

  Dialogues come from the sample's intent grammar filled from PUBLIC_POOLS,
  are written in the dataflow-dialogue format and read back with
  `dpjax.data.readers.semparse.read_turns`, so the turns (skip dropped, programs
  linearized, TreeDST domains) are exactly the examples the tasks would see.
  One document per turn, as the GPT-2 tasks join their prompt and target
  (`tasks.semparse`; the prompt's tokens followed by the target's):
  `parse_prompt(program) + utterance` (2-stage), or for a
  PUBLIC_DOMAIN_PROMPT_FRACTION of TreeDST turns `domain_prompt(domain) +
  utterance` (1.5-stage).
  """
  import tempfile  # pylint: disable=g-import-not-at-top

  rng = random.Random(seed + _PUBLIC_SEED_OFFSETS[(dataset, split)])
  make = _smcalflow_dialogue if dataset == "smcalflow" else _treedst_dialogue
  lines = [_dialogue_json(f"public-{dataset}-{split}-{i}", make(rng, PUBLIC_POOLS))
           for i in range(PUBLIC_NUM_DIALOGUES[split])]
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "dialogues.jsonl")
    _write_lines(path, lines)
    turns = list(semparse.read_turns(path, with_domains=dataset == "treedst"))
  docs = []
  for t in turns:
    if t.domain is not None and rng.random() < PUBLIC_DOMAIN_PROMPT_FRACTION:
      docs.append(semparse_tasks.domain_prompt(t.domain) + t.utterance)
    else:
      docs.append(semparse_tasks.parse_prompt(t.program) + t.utterance)
  return docs


def _split_stats(docs: list[str], path: str) -> dict:
  return {"documents": len(docs), "words": sum(len(d.split()) for d in docs),
          "characters": sum(len(d) for d in docs),
          "bytes": os.path.getsize(path)}


def _tokenizer_stats(docs: list[str]) -> tuple[float, float]:
  """(GPT-2 BPE tokens per whitespace word, SentencePiece unk rate)."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from tokenizers import ByteLevelBPETokenizer  # pylint: disable=g-import-not-at-top

  bpe = ByteLevelBPETokenizer(semparse_tasks.DEFAULT_BPE_VOCAB_PATH,
                              semparse_tasks.DEFAULT_BPE_MERGES_PATH)
  sp = spm.SentencePieceProcessor(model_file=semparse_tasks.DEFAULT_SENTENCEPIECE_PATH)
  tokens = sum(len(e.ids) for e in bpe.encode_batch(docs))
  pieces = sp.encode(docs)
  unk = sum(x.count(sp.unk_id()) for x in pieces)
  return (tokens / sum(len(d.split()) for d in docs),
          unk / sum(len(x) for x in pieces))


def _public_readme(stats: dict, seed: int, counts: dict, tok: dict) -> str:
  rows = [
      "# semparse_public", "",
      "A public pretraining corpus for the SMCalFlow/TreeDST (semantic parsing)",
      "world: the same language as the private samples (`smcalflow_sample`,",
      "`treedst_sample`) with none of their named entities. Generated",
      "(deterministic; do not edit by hand) by", "",
      "    python -m tasks.semparse_sample.generate --public_corpus", "",
      f"(`generate_public_corpus`, seed {seed}). `train.jsonl` and",
      "`validation.jsonl` hold one JSON object `{\"text\": document}` per line.",
      "",
      "## Documents", "",
      "One document per human turn (turns with `skip` true dropped), rendered",
      "as the GPT-2 tasks of `tasks/semparse.py` join prompt and target, with",
      "no special token: `parse: <linearized Lispress>\\nutterance:<utterance>`",
      "(2-stage `parse_to_utterance`; the utterance follows the colon directly",
      "because the task tokenizes prompt and target separately and",
      "concatenates them, so byte-level BPE gives the document exactly the",
      "task's token ids), or, for "
      f"{PUBLIC_DOMAIN_PROMPT_FRACTION:.0%} of TreeDST turns,",
      "`domain: <domain>\\nutterance:<utterance>` (1.5-stage). Every document",
      "of the first kind pairs an utterance with its parse, which the T5",
      "parser (utterance -> program) also needs to learn both languages from",
      "span corruption. Dialogues alternate SMCalFlow and TreeDST; a",
      "validation document that also occurs in train is dropped.", "",
      "| statistic | train | validation |", "| --- | --- | --- |"]
  for key in ("documents", "words", "characters", "bytes"):
    rows.append(f"| {key} | {stats['train'][key]} | {stats['validation'][key]} |")
  for key, label in (("smcalflow", "SMCalFlow turns"), ("treedst", "TreeDST turns"),
                     ("domain", "domain-prompt documents")):
    rows.append(f"| {label} | {counts['train'][key]} | {counts['validation'][key]} |")
  rows += [
      "", "Tokenizers (`semparse_vocab`, unchanged): GPT-2 BPE tokens per",
      f"whitespace word {tok['public'][0]:.3f} on public train vs "
      f"{tok['private'][0]:.3f} on the private",
      "train turns rendered the same way; SentencePiece unk rate "
      f"{tok['public'][1]:.4f} vs {tok['private'][1]:.4f}.", "",
      "## Disjointness from the private sample", "",
      "The intents and templates (the language, including the Lispress",
      "function names, dates, times, numbers, cuisines, cabin classes and",
      "TreeDST domains) are the sample generator's; every named entity comes",
      "from `PUBLIC_POOLS` instead of `SAMPLE_POOLS`: person first and last",
      "names, towns, venues, rooms, event subjects, message bodies, reminder",
      "contents, attraction categories and hotel-name suffixes (so hotel and",
      "attraction names too). The generator refuses to run unless the two pool",
      "sets share no entity (as whole words, case-insensitively) and no",
      "capitalised word (`_check_disjoint`). Independently,",
      "`tests/semparse/test_semparse_public_corpus.py` reads the committed",
      "private files and checks that no string literal of a private program",
      "(except `Path.apply` paths) occurs as whole words in any public",
      "document, and that no capitalised word of a private literal or of a",
      "private utterance (after its first word) occurs as a word, unless it",
      "is part of a private program's function or constructor names (days,",
      "months, `Hotel`, ...)."]
  return "\n".join(rows) + "\n"


def generate_public_corpus(output_dir: str = DEFAULT_PUBLIC_DIR, *,
                           seed: int = PUBLIC_SEED) -> dict:
  """Writes the public pretraining corpus (train/validation JSONL, README).

  Returns {split: {"documents", "words", "characters", "bytes"}}.
  """
  _check_disjoint(SAMPLE_POOLS, PUBLIC_POOLS)
  docs, counts = {}, {}
  for split in PUBLIC_FILES:
    per_dataset = {d: public_documents(d, split, seed) for d in semparse.DATASETS}
    # Alternate the two datasets in blocks of about a dialogue's length.
    merged = []
    n = max(len(x) for x in per_dataset.values())
    for i in range(0, n, 2):
      for d in semparse.DATASETS:
        merged += per_dataset[d][i:i + 2]
    counts[split] = {d: len(x) for d, x in per_dataset.items()}
    if split == "validation":
      train = set(docs["train"])
      merged = [d for d in merged if d not in train]
      counts[split] = {d: sum(1 for x in per_dataset[d] if x not in train)
                       for d in per_dataset}
    counts[split]["domain"] = sum(1 for x in merged if x.startswith("domain: "))
    docs[split] = merged
  os.makedirs(output_dir, exist_ok=True)
  stats = {}
  for split, name in PUBLIC_FILES.items():
    path = os.path.join(output_dir, name)
    text_corpus.write_documents(path, docs[split])
    stats[split] = _split_stats(docs[split], path)
  private = [semparse_tasks.parse_prompt(t.program) + t.utterance
             for d in semparse.DATASETS for t in semparse.load_turns(d, "train")]
  tok = {"public": _tokenizer_stats(docs["train"]),
         "private": _tokenizer_stats(private)}
  with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8",
            newline="\n") as f:
    f.write(_public_readme(stats, seed, counts, tok))
  return stats


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR)
  parser.add_argument("--no_vocab", action="store_true",
                      help="skip training the BPE and SentencePiece vocabularies")
  parser.add_argument("--public_corpus", action="store_true",
                      help="write the public pretraining corpus (to "
                      "DEFAULT_PUBLIC_DIR unless --output_dir) instead")
  args = parser.parse_args(argv)
  if args.public_corpus:
    output_dir = (DEFAULT_PUBLIC_DIR if args.output_dir == DEFAULT_OUTPUT_DIR
                  else args.output_dir)
    print(json.dumps(generate_public_corpus(output_dir), indent=1))
    return
  generate(args.output_dir, train_vocabularies=not args.no_vocab)
  for name in DIRS.values():
    path = os.path.join(args.output_dir, name, "README.md")
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        print(f.read())


if __name__ == "__main__":
  main()
