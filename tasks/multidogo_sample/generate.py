"""Deterministic generator of a small MultiDoGo-format sample.

Run ``python -m tasks.multidogo_sample.generate`` (optionally
``--output_dir``) to (re)create ``tasks/data/multidogo_sample/``:

* ``airline.tsv``, ``media.tsv``, ``insurance.tsv``: customer-service
  conversations of the paper's three domains in the layout of the release's
  ``data/unannotated/`` files (see `tasks.multidogo`): a header, then one
  comma-separated row per utterance ``conversationId, turnNumber,
  utteranceId, utterance, authorRole`` (customer / agent), quoted where
  needed; some agent utterances end in a newline inside quotes, as in the
  release.
* ``keywords.json``: hand-picked per-domain phrases for the keyword policy
  (company names and domain terms; like the paper's lists, not the
  sensitive values themselves).
* ``bpe/vocab.json`` + ``bpe/merges.txt``: GPT-2-format byte-level BPE
  trained on the train split's utterances (`tasks.multidogo.CONTROL_TOKENS`
  are not in it: the task appends them as extra tokens).
* ``README.md`` with statistics.

With ``--public_corpus`` it writes instead the public pretraining corpus
``tasks/data/multidogo_public/`` (`generate_public_corpus`): conversations of
the three other MultiDoGo domains (FASTFOOD, FINANCE, SOFTWARE) from the same
machinery with their own companies, intents and name/place pools, rendered
one conversation per line as ``Agent: ... Customer: ...`` (the task's text
without its control tokens), in ``train.jsonl`` / ``validation.jsonl``; no
document holds a phrase of ``keywords.json`` or a word of the sample's
entity pools.

Each domain has its own companies and intents (AIRLINE: bookings, seat
changes, seat numbers, boarding passes; MEDIA: new connections, data plans,
bills, outages; INSURANCE: proof of insurance, claims, payments) and its own
sensitive values: booking confirmation numbers, seat and flight numbers;
account numbers, zip codes and addresses; policy and claim numbers, SSN
digits and cars. Greetings, names, e-mail addresses, card numbers and
closings are shared, so a domain cannot be told from them alone. All
companies, people and numbers are invented.

Determinism: one ``random.Random`` per domain from fixed seeds, only ordered
containers; BPE is trained on a fixed list of texts. Needs the standard
library, ``tokenizers`` and the (pure Python) `tasks.multidogo` readers; no
TensorFlow.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re

from dpjax.data.readers import multidogo, text_corpus
from dpjax.data.text import redaction
from tasks.semparse_sample.generate import train_bpe

SEEDS = {"AIRLINE": 8101, "MEDIA": 8102, "INSURANCE": 8103}
NUM_CONVERSATIONS = 300  # per domain
BPE_VOCAB_SIZE = 2000  # at most, including <|endoftext|>
DEFAULT_OUTPUT_DIR = multidogo.DEFAULT_DATA_DIR
HEADER = ("conversationId", "turnNumber", "utteranceId", "utterance", "authorRole")

COMPANIES = {
    "AIRLINE": ("Skylark Airways", "Bluecrest Air", "Nimbus Airlines",
                "Corvid Air", "Halcyon Airways"),
    "MEDIA": ("Brightwire Cable", "Orbitlink Media", "Netstream Broadband",
              "Cloudpeak Cable Services", "Vistanet Media"),
    "INSURANCE": ("Harborline Insurance", "Keystone Mutual",
                  "Evergreen Assurance", "Summitguard Insurance"),
}
KEYWORDS = {
    "AIRLINE": ("airline", "airlines", "airways", "flight", "flights",
                "boarding pass", "seat", "seat number", "seat assignment",
                "window seat", "aisle seat", "middle seat",
                "booking confirmation number", "confirmation number",
                "passengers", "date of travel"),
    "MEDIA": ("internet", "internet connection", "cable", "cable connection",
              "data plan", "data plans", "zip code", "account number",
              "router", "wifi", "technician", "installation", "bill"),
    "INSURANCE": ("insurance", "proof of insurance", "policy number", "claim",
                  "claim number", "car", "SSN", "premium", "adjuster",
                  "repair estimate", "make, model and year"),
}

_FIRST = ("Priya", "Arjun", "Maya", "Daniel", "Sofia", "Ravi", "Lena", "Omar",
          "Grace", "Kiran", "Tomas", "Anita", "Felix", "Nadia", "Victor",
          "Elena", "Samir", "Julia", "Marco", "Aisha", "Leo", "Hana", "Ivan",
          "Rosa", "Dev", "Meera", "Caleb", "Ines")
_LAST = ("Raman", "Okafor", "Lindqvist", "Moreau", "Castillo", "Varga",
         "Nakamura", "Brennan", "Iyer", "Kowalski", "Haddad", "Sorensen")
_AGENTS = ("Cameron", "Robin", "Drew", "Jordan", "Avery", "Morgan", "Sam")
_MAIL = ("mailbox.com", "postly.net", "inboxer.org")
_CITIES = ("Chennai", "Mumbai", "Denver", "Miami", "Boston", "Seattle",
           "Austin", "Dallas", "Chicago", "Atlanta", "Phoenix", "Portland",
           "Delhi", "Bangalore", "Toronto", "Houston")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July",
           "August", "September", "October", "November", "December")
_STREETS = ("Maple", "Cedar", "Lakeview", "Hillcrest", "Oak", "Sunset",
            "River", "Park", "Willow", "Harbor")
_STREET_KINDS = ("Street", "Avenue", "Road", "Lane", "Drive")
_FLIGHT_CODES = {"Skylark Airways": "SK", "Bluecrest Air": "BC",
                 "Nimbus Airlines": "NM", "Corvid Air": "CV",
                 "Halcyon Airways": "HA"}
_SEAT_KINDS = {"window": "AF", "aisle": "CD", "middle": "BE"}
_PLANS = ("10 GB", "25 GB", "50 GB", "100 GB", "unlimited")
_CARS = ("Toyota Corolla", "Honda Civic", "Ford Focus", "Hyundai Elantra",
         "Mazda 3", "Subaru Outback", "Kia Soul", "Nissan Altima")
_CLAIM_STATUS = ("approved and the payment will reach you in 3 days",
                 "under review by our adjuster",
                 "waiting for the repair estimate from the garage")


# ---------------------------------------------------------------------------
# Shared values.
# ---------------------------------------------------------------------------


def _name(rng, first=_FIRST, last=_LAST):
  return rng.choice(first), rng.choice(last)


def _email(rng, first, mail=_MAIL):
  return f"{first.lower()}{rng.randint(1, 99)}@{rng.choice(mail)}"


def _card(rng):
  return " ".join(f"{rng.randint(0, 9999):04d}" for _ in range(4))


def _date(rng):
  return f"{rng.choice(_MONTHS)} {rng.randint(1, 28)}"


def _address(rng, streets=_STREETS):
  return f"{rng.randint(2, 980)} {rng.choice(streets)} {rng.choice(_STREET_KINDS)}"


def _digits(rng, n):
  return "".join(str(rng.randint(0, 9)) for _ in range(n))


def _seat(rng, kind=None):
  kind = kind or rng.choice(tuple(_SEAT_KINDS))
  return f"{rng.randint(1, 38)}{rng.choice(_SEAT_KINDS[kind])}", kind


# ---------------------------------------------------------------------------
# Intents: each returns the (role, text) turns after the greeting.
# ---------------------------------------------------------------------------


def _ask_name(rng, first, last):
  return [("agent", rng.choice(("May I know your name please?",
                                "Could you please help me with your name?",
                                "Sure! May I have your full name?"))),
          ("customer", rng.choice((f"{first} {last}", f"my name is {first}",
                                   first)))]


def _airline_booking(rng, company, first, last):
  c1, c2 = rng.sample(_CITIES, 2)
  seat, kind = _seat(rng, rng.choice(("window", "aisle")))
  return [
      ("customer", rng.choice((f"i want to book a flight from {c1} to {c2}",
                               f"i need a ticket from {c1} to {c2}",
                               f"book a flight to {c2} from {c1} please"))),
      ("agent", "Sure! May I know your preferred date of travel?"),
      ("customer", rng.choice((_date(rng), f"on {_date(rng)}"))),
      ("agent", "How many passengers will be travelling?"),
      ("customer", rng.choice(("just me", f"{rng.randint(2, 5)} passengers"))),
      ("agent", f"I found flight {_FLIGHT_CODES[company]} {rng.randint(100, 999)} "
                f"departing {c1} at {rng.randint(1, 12)}:{rng.choice(('05', '30', '45'))} "
                f"for ${rng.randint(89, 640)} per ticket. Shall I book it?"),
      ("customer", rng.choice(("yes please", "ok book it", "sure"))),
      ("agent", "Could you please share your card number for the payment?"),
      ("customer", _card(rng)),
      ("agent", f"Your flight is booked! Your booking confirmation number is "
                f"{_booking_ref(rng)}. Would you like a window or an aisle seat?"),
      ("customer", f"{kind} seat please"),
      ("agent", f"Great! I've allotted you seat {seat}, {'a' if kind != 'aisle' else 'an'} "
                f"{kind} seat."),
  ]


def _booking_ref(rng):
  return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))


def _airline_lookup(rng, first, last):
  ref = _booking_ref(rng)
  return _ask_name(rng, first, last) + [
      ("agent", f"Thanks {first}! Could you please share your booking "
                "confirmation number?"),
      ("customer", rng.choice((ref, ref.lower(), f"confirmation number {ref.lower()}",
                               " ".join(ref.lower())))),
  ]


def _airline_seat_change(rng, company, first, last):
  old, _ = _seat(rng)
  new, kind = _seat(rng)
  flight = f"{_FLIGHT_CODES[company]} {rng.randint(100, 999)}"
  return [("customer", rng.choice(("i want to change my seat assignment",
                                   "can you change my seat", "i need a different seat")))
          ] + _airline_lookup(rng, first, last) + [
      ("agent", f"You are currently in seat {old} on flight {flight}. Would you "
                "prefer a window, aisle or middle seat?"),
      ("customer", f"{kind} seat please"),
      ("agent", f"Done! You've been allotted {new}, which is {'an' if kind == 'aisle' else 'a'} "
                f"{kind} seat. Is that fine with you?"),
      ("customer", rng.choice(("ok", "perfect", "yes thank you"))),
  ]


def _airline_seat_info(rng, company, first, last):
  seat, _ = _seat(rng)
  c1, c2 = rng.sample(_CITIES, 2)
  return [("customer", rng.choice(("i want to know my seat number",
                                   "what is my seat no", "check my seat please")))
          ] + _airline_lookup(rng, first, last) + [
      ("agent", f"Your seat number is {seat} on flight {_FLIGHT_CODES[company]} "
                f"{rng.randint(100, 999)} from {c1} to {c2} on {_date(rng)}."),
  ]


def _airline_boarding_pass(rng, company, first, last):
  email = _email(rng, first)
  return [("customer", rng.choice(("please send me my boarding pass",
                                   "i need my boarding pass", "boarding pass to my mail")))
          ] + _airline_lookup(rng, first, last) + [
      ("agent", "Where would you like me to send it?"),
      ("customer", rng.choice((email, f"to {email}"))),
      ("agent", f"Your boarding pass for flight {_FLIGHT_CODES[company]} "
                f"{rng.randint(100, 999)} has been sent to {email}."),
  ]


def _account(rng):
  return f"{_digits(rng, 3)}-{_digits(rng, 4)}-{_digits(rng, 3)}"


def _media_new(rng, company, first, last):
  p1, p2 = rng.sample(_PLANS, 2)
  acct = _account(rng)
  return [
      ("customer", rng.choice(("i want a new internet connection",
                               "i want to sign up for cable tv",
                               "i want to purchase a new cable connection"))),
      ("agent", "Sure! May I know your city and zip code?"),
      ("customer", f"{rng.choice(_CITIES)} {_digits(rng, 5)}"),
      ("agent", f"We offer the {p1} data plan for ${rng.randint(15, 60)} per month "
                f"and the {p2} plan for ${rng.randint(25, 90)} per month. Which data "
                "plan would you like?"),
      ("customer", rng.choice((f"the {p2} plan", f"{p1} please"))),
      ] + _ask_name(rng, first, last) + [
      ("agent", "Could you please share your address for the installation?"),
      ("customer", _address(rng)),
      ("agent", f"Your new connection will be installed on {_date(rng)}. Your "
                f"account number is {acct}."),
  ]


def _media_bill(rng, company, first, last):
  amount = f"{rng.randint(20, 180)}.{_digits(rng, 2)}"
  return [
      ("customer", rng.choice(("i want to check my bill", "why is my bill so high",
                               "i want to pay my bill"))),
      ("agent", "Could you please share your account number?"),
      ("customer", _account(rng)),
      ("agent", f"Your current bill is ${amount} and it is due on {_date(rng)}. "
                "Would you like to pay now?"),
      ("customer", rng.choice(("yes", "ok"))),
      ("agent", "Please share your card number."),
      ("customer", _card(rng)),
      ("agent", f"Payment of ${amount} received, thank you {first}!"),
  ]


def _media_upgrade(rng, company, first, last):
  p1, p2 = rng.sample(_PLANS, 2)
  return [
      ("customer", rng.choice(("i want to upgrade my data plan",
                               "can i get more data", "change my internet plan"))),
      ("agent", "May I have your account number?"),
      ("customer", _account(rng)),
      ("agent", f"You are on the {p1} plan. We can move you to the {p2} plan for "
                f"${rng.randint(25, 90)} per month."),
      ("customer", rng.choice(("ok do it", "yes please upgrade"))),
      ("agent", f"Your data plan is now {p2}, starting {_date(rng)}."),
  ]


def _media_outage(rng, company, first, last):
  fixed = rng.random() < 0.5
  return [
      ("customer", rng.choice(("my internet is not working",
                               "my wifi keeps disconnecting", "no signal on my cable tv"))),
      ("agent", "I'm sorry to hear that. Could you share your account number?"),
      ("customer", _account(rng)),
      ("agent", "Please restart your router and wait for two minutes."),
      ("customer", "it works now" if fixed else "done, still not working"),
      ("agent", "Glad it works again!" if fixed else
       f"I've booked a technician visit at {_address(rng)} on {_date(rng)}."),
  ]


def _policy_number(rng):
  return f"{rng.choice('HKES')}{rng.choice('XPRW')}-{_digits(rng, 6)}"


def _claim_number(rng):
  return f"CLM{_digits(rng, 5)}"


def _insurance_proof(rng, company, first, last):
  year, car, email = rng.randint(2008, 2023), rng.choice(_CARS), _email(rng, first)
  return [("customer", rng.choice(("i need proof of insurance for my car",
                                   "I NEED PROOF ON INSURANCE ON MY CAR",
                                   "send me my insurance card")))
          ] + _ask_name(rng, first, last) + [
      ("agent", f"Thanks {first}! Could you please share your policy number?"),
      ("customer", _policy_number(rng)),
      ("agent", "Could you tell me the make, model and year of your car?"),
      ("customer", f"{year} {car}"),
      ("agent", "Where should I send the proof of insurance?"),
      ("customer", email),
      ("agent", f"I've emailed the proof of insurance for your {year} {car} to {email}."),
  ]


def _insurance_claim_status(rng, company, first, last):
  claim = _claim_number(rng)
  return [
      ("customer", rng.choice(("i want to know the status of my claim",
                               "what happened to my claim", "claim status please"))),
      ("agent", "Could you please share your claim number?"),
      ("customer", rng.choice((claim, claim.lower()))),
      ("agent", f"Your claim {claim} is {rng.choice(_CLAIM_STATUS)}."),
  ]


def _insurance_new_claim(rng, company, first, last):
  return [
      ("customer", rng.choice(("my car was hit in a parking lot",
                               "my phone screen cracked", "i want to file a claim"))),
      ("agent", "I'm sorry to hear that. Could you please share the last 4 digits "
                "of your SSN?"),
      ("customer", _digits(rng, 4)),
      ("agent", "And your policy number?"),
      ("customer", _policy_number(rng)),
      ("agent", "When did the incident happen?"),
      ("customer", rng.choice((_date(rng), "yesterday", "last night"))),
      ("agent", f"I've registered your claim. Your claim number is {_claim_number(rng)}."),
  ]


def _insurance_payment(rng, company, first, last):
  card = _card(rng)
  return [
      ("customer", rng.choice(("i want to update my payment card",
                               "change the card for my premium"))),
      ("agent", "Could you share your policy number?"),
      ("customer", _policy_number(rng)),
      ("agent", "Please share the new card number."),
      ("customer", card),
      ("agent", f"Your premium of ${rng.randint(40, 260)} will now be charged to the "
                f"card ending in {card[-4:]}."),
  ]


INTENTS = {
    "AIRLINE": (_airline_booking, _airline_seat_change,
                _airline_seat_info, _airline_boarding_pass),
    "MEDIA": (_media_new, _media_bill, _media_upgrade, _media_outage),
    "INSURANCE": (_insurance_proof, _insurance_claim_status, _insurance_new_claim,
                  _insurance_payment),
}


def _customer_style(rng):
  r = rng.random()
  if r < 0.5:
    return str.lower
  if r < 0.65:
    return str.upper
  return lambda s: s[:1].upper() + s[1:]


def conversation(rng: random.Random, domain: str, *, companies=COMPANIES,
                 intents=INTENTS, first_names=_FIRST, last_names=_LAST,
                 agents=_AGENTS) -> list[tuple[str, str]]:
  """(authorRole, utterance) of one conversation. The keyword arguments
  are the entity pools and intents (the sample's by default; the public
  corpus passes its own)."""
  company = rng.choice(companies[domain])
  first, last = _name(rng, first_names, last_names)
  greeting = ("agent", rng.choice((
      f"Hello! You've reached {company} customer service. How may I help you today?",
      f"Hi there, good morning! Welcome to {company}. You're connected to "
      f"{rng.choice(agents)}. How may I assist you?",
      f"Thank you for contacting {company}! How can I help you today?")))
  opener = [("customer", rng.choice(("hi", "hai", "hello", "good morning")))]
  turns = (opener + [greeting] if rng.random() < 0.5 else [greeting])
  turns += rng.choice(intents[domain])(rng, company, first, last)
  turns += [("agent", "Is there anything else I can help you with?"),
            ("customer", rng.choice(("no thanks", "nothing else",
                                     "no that's all, thank you"))),
            ("agent", f"Thank you for contacting {company}. Have a nice day!")]
  style = _customer_style(rng)
  out = []
  for role, text in turns:
    if role == "customer":
      text = style(text)
    elif rng.random() < 0.1:
      text += "\n"  # as some agent utterances of the release
    out.append((role, text))
  return out


def _conversation_id(rng: random.Random) -> str:
  h = f"{rng.getrandbits(128):032x}"
  return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def build(domain: str) -> str:
  """The text of one domain's file."""
  rng = random.Random(SEEDS[domain])
  buf = io.StringIO()
  writer = csv.writer(buf, lineterminator="\n")
  writer.writerow(HEADER)
  for _ in range(NUM_CONVERSATIONS):
    cid = _conversation_id(rng)
    for turn, (role, text) in enumerate(conversation(rng, domain)):
      writer.writerow((cid, turn, f"<CONV>{cid}<TURN>{turn}", text, role))
  return buf.getvalue()


def _readme(output_dir: str, conversations: list[multidogo.Conversation]) -> str:
  import tokenizers  # pylint: disable=g-import-not-at-top

  tok = tokenizers.ByteLevelBPETokenizer(
      os.path.join(output_dir, "bpe", "vocab.json"),
      os.path.join(output_dir, "bpe", "merges.txt"))
  tok.add_special_tokens(list(multidogo.CONTROL_TOKENS))
  rows = ["# multidogo_sample", "",
          "A fictional MultiDoGo-format sample generated by",
          "`python -m tasks.multidogo_sample.generate` (deterministic; do not edit",
          "by hand), in the layout of the release's `data/unannotated/` files",
          "(comma-separated despite the `.tsv` names, like the release). Read it",
          "with `tasks.multidogo.load_conversations`. `keywords.json` holds the",
          "keyword policy's phrases; `bpe/` a byte-level BPE trained on the train",
          "split's utterances (the task appends `tasks.multidogo.CONTROL_TOKENS`).",
          "", "| statistic | value |", "| --- | --- |"]
  for domain in SEEDS:
    convs = [c for c in conversations if c.domain == domain]
    splits = [len(multidogo.split_conversations(convs, s)) for s in multidogo.SPLITS]
    lengths = [len(e.ids) for e in tok.encode_batch(
        [multidogo.format_conversation(c) for c in convs])]
    rows.append(f"| {domain}: conversations (train / validation / test) / "
                f"utterances | {len(convs)} ({' / '.join(map(str, splits))}) / "
                f"{sum(len(c.utterances) for c in convs)} |")
    rows.append(f"| {domain}: task tokens per conversation, mean / max | "
                f"{sum(lengths) / len(lengths):.1f} / {max(lengths)} |")
  rows.append(f"| BPE vocabulary (without control tokens) | "
              f"{tok.get_vocab_size() - len(multidogo.CONTROL_TOKENS)} |")
  return "\n".join(rows) + "\n"


def generate(output_dir: str = DEFAULT_OUTPUT_DIR, *,
             train_vocabulary: bool = True) -> list[multidogo.Conversation]:
  """Writes the sample under `output_dir`; returns its conversations as
  `tasks.multidogo` reads them back."""
  os.makedirs(output_dir, exist_ok=True)
  for domain in SEEDS:
    with open(os.path.join(output_dir, f"{domain.lower()}.tsv"), "w",
              encoding="utf-8", newline="") as f:
      f.write(build(domain))
  with open(os.path.join(output_dir, "keywords.json"), "w", encoding="utf-8",
            newline="\n") as f:
    json.dump({d: [*COMPANIES[d], *KEYWORDS[d]] for d in SEEDS}, f, indent=2)
    f.write("\n")
  conversations = multidogo.load_conversations(output_dir, tuple(SEEDS))
  if train_vocabulary:
    bpe_dir = os.path.join(output_dir, "bpe")
    os.makedirs(bpe_dir, exist_ok=True)
    train = multidogo.split_conversations(conversations, "train")
    train_bpe([u.text for c in train for u in c.utterances], bpe_dir,
              vocab_size=BPE_VOCAB_SIZE)
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8",
              newline="\n") as f:
      f.write(_readme(output_dir, conversations))
  return conversations


# ---------------------------------------------------------------------------
# The public pretraining corpus: the other three MultiDoGo domains.
# ---------------------------------------------------------------------------

PUBLIC_SEED = 8190
PUBLIC_NUM_CONVERSATIONS = 1500  # all domains together, before the split
PUBLIC_VALIDATION_FRACTION = 0.05
DEFAULT_PUBLIC_DIR = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "data", "multidogo_public")
PUBLIC_DOMAINS = ("FASTFOOD", "FINANCE", "SOFTWARE")
# How a public document names the speakers. Not the task's "SYS:" / "USR:":
# those are control tokens (`multidogo.CONTROL_TOKENS`), appended to the
# vocabulary only at fine-tuning time.
PUBLIC_ROLE_NAMES = {"customer": "Customer:", "agent": "Agent:", "bot": "Agent:"}

PUBLIC_COMPANIES = {
    "FASTFOOD": ("Crispy Crown", "Burger Bay", "Taco Trail", "Noodle Nook",
                 "Pepper Palace"),
    "FINANCE": ("Ironleaf Bank", "Copperfield Credit Union", "Northgate Savings",
                "Bluewater Bank", "Granite Trust"),
    "SOFTWARE": ("Pixelforge Software", "Codewell", "Quillsoft", "Tidewave Apps",
                 "Lumen Labs"),
}
# Disjoint from the sample's pools (`_FIRST`, `_LAST`, `_AGENTS`, `_MAIL`,
# `_CITIES`, `_STREETS`); `_public_corpus_policy` checks every document.
_PUBLIC_FIRST = ("Amara", "Bruno", "Chloe", "Dmitri", "Esther", "Farid",
                 "Gemma", "Hugo", "Isla", "Jonas", "Keiko", "Lucas", "Mina",
                 "Nikhil", "Olga", "Pablo", "Quentin", "Rahul", "Sana", "Theo",
                 "Uma", "Wen", "Yara", "Zane", "Bianca", "Tariq", "Noor", "Ezra")
_PUBLIC_LAST = ("Adeyemi", "Bergstrom", "Chatterjee", "Duarte", "Fischer",
                "Gallagher", "Hosseini", "Jovanovic", "Kimura", "Laurent",
                "Mendoza", "Novak", "Osei", "Petrov")
_PUBLIC_AGENTS = ("Casey", "Riley", "Jamie", "Taylor", "Alex", "Skyler", "Reese")
_PUBLIC_MAIL = ("letterly.com", "mailcove.io", "postbird.net")
_PUBLIC_CITIES = ("Lisbon", "Nairobi", "Oslo", "Lagos", "Perth", "Dublin",
                  "Kyoto", "Lima", "Quito", "Tampa", "Reno", "Omaha", "Tucson",
                  "Fresno", "Pune", "Jaipur")
_PUBLIC_STREETS = ("Birch", "Elm", "Aspen", "Meadow", "Orchard", "Juniper",
                   "Chestnut", "Ridge", "Poplar", "Brook")
_MENU = ("cheeseburger", "chicken wrap", "veggie burger", "pepperoni pizza",
         "margherita pizza", "fish taco", "falafel bowl", "club sandwich",
         "paneer roll", "chicken burrito")
_SIDES = ("fries", "onion rings", "a side salad", "garlic bread", "coleslaw")
_DRINKS = ("cola", "lemonade", "iced tea", "orange juice", "milkshake")
_SIZES = ("small", "medium", "large")
_COUNT_WORDS = ("one", "two", "three", "four")
_BANK_ACCOUNTS = ("checking", "savings")
_PRODUCTS = ("PhotoPad", "Notewise", "TaskTide", "SheetLab", "Clipvault")
_SOFTWARE_PLANS = ("Basic", "Pro", "Team", "Business", "Starter")
_DEVICES = ("laptop", "windows pc", "mac", "tablet", "phone")
# Keys and codes use no vowels and 4-character groups, so they never spell a
# word (the corpus check would reject one anyway).
_KEY_CHARS = "BCDFGHJKLMNPQRSTVWXZ23456789"


def _plural(item, n):
  if n == 1:
    return item
  return item + ("es" if item.endswith("ch") else "s")


def _price(rng, low, high):
  return f"{rng.randint(low, high)}.{rng.choice(('25', '49', '75', '99'))}"


def _public_address(rng):
  return _address(rng, _PUBLIC_STREETS)


def _public_email(rng, first):
  return _email(rng, first, _PUBLIC_MAIL)


def _order_number(rng):
  return f"{rng.choice('ABCDEFGHJKLMNPRSTWXYZ')}{_digits(rng, 5)}"


def _fastfood_order(rng, company, first, last):
  item, n = rng.choice(_MENU), rng.randint(1, 4)
  meal, delivery = rng.random() < 0.5, rng.random() < 0.6
  minutes = rng.choice((15, 20, 25, 30, 40))
  turns = [
      ("customer", rng.choice((
          f"i want to order {_COUNT_WORDS[n - 1]} {_plural(item, n)}",
          f"can i get {n} {_plural(item, n)}",
          f"i'd like to place an order for {_COUNT_WORDS[n - 1]} {_plural(item, n)}"))),
      ("agent", f"Sure! Would you like to make it a meal with {rng.choice(_SIDES)} "
                f"and a drink for ${_price(rng, 2, 5)} more?"),
      ("customer", rng.choice(("yes please", "ok make it a meal")) if meal
       else rng.choice((f"no just the {_plural(item, n)}", "no thanks"))),
  ]
  if meal:
    turns += [("agent", "Which drink would you like, and what size?"),
              ("customer", f"{rng.choice(_SIZES)} {rng.choice(_DRINKS)}")]
  turns += [("agent", "Is this for delivery or pickup?"),
            ("customer", "delivery" if delivery else "pickup")]
  if delivery:
    turns += [("agent", "Could you please share your delivery address?"),
              ("customer", _public_address(rng))]
  else:
    turns += [("agent", "Which store would you like to pick it up from?"),
              ("customer", f"the one in {rng.choice(_PUBLIC_CITIES)}")]
  turns += _ask_name(rng, first, last) + [
      ("agent", f"Your total is ${_price(rng, 6, 48)}. Could you please share "
                "your card number for the payment?"),
      ("customer", _card(rng)),
      ("agent", f"Your order is placed! Your order number is {_order_number(rng)}. "
                + (f"It will be delivered in {minutes} minutes." if delivery else
                   f"It will be ready for pickup in {minutes} minutes.")),
  ]
  return turns


def _fastfood_status(rng, company, first, last):
  order = _order_number(rng)
  return [
      ("customer", rng.choice(("where is my order", "my food has not arrived yet",
                               "how long will my order take"))),
      ("agent", "Could you please share your order number?"),
      ("customer", rng.choice((order, order.lower(), f"order number {order.lower()}"))),
      ("agent", f"Your order {order} is out for delivery. Our driver "
                f"{rng.choice(_PUBLIC_AGENTS)} will reach you in "
                f"{rng.choice((5, 10, 15, 20))} minutes."),
      ("customer", rng.choice(("ok thanks", "great", "thank you"))),
  ]


def _fastfood_complaint(rng, company, first, last):
  item = rng.choice(_MENU)
  refund = rng.random() < 0.5
  return [("customer", rng.choice(("my order was wrong", "my fries were cold",
                                   "you forgot my drink",
                                   f"the {item} was missing from my order")))
          ] + _ask_name(rng, first, last) + [
      ("agent", f"I'm sorry about that, {first}. Could you please share your order "
                "number?"),
      ("customer", _order_number(rng)),
      ("agent", "Would you like a refund or a replacement?"),
      ("customer", "refund please" if refund else "a replacement please"),
      ("agent", f"I've issued a refund of ${_price(rng, 4, 30)} to your card. It will "
                "show up in 3 to 5 days." if refund else
       f"A fresh {item} is on its way and will reach you in "
       f"{rng.choice((20, 25, 30))} minutes."),
  ]


def _fastfood_store(rng, company, first, last):
  city = rng.choice(_PUBLIC_CITIES)
  return [
      ("customer", rng.choice((f"what time does your {city} store close",
                               f"is your store in {city} open now",
                               f"where is your nearest store in {city}"))),
      ("agent", f"Our store at {_public_address(rng)} in {city} is open from "
                f"{rng.randint(6, 11)} am to {rng.randint(9, 11)} pm every day."),
      ("customer", rng.choice(("do you deliver to my area", "can i order online"))),
      ("agent", f"Yes! We deliver within {rng.randint(3, 8)} miles of the store, and "
                "you can order on our app or website."),
  ]


def _fastfood_coupon(rng, company, first, last):
  code = f"SAVE{rng.choice((10, 15, 20, 25))}"
  return [
      ("customer", rng.choice(("i have a coupon code", "can i use a coupon",
                               "my coupon is not working"))),
      ("agent", "Sure! Could you please share the coupon code?"),
      ("customer", rng.choice((code, code.lower()))),
      ("agent", f"The code {code} gives you {code[4:]}% off orders above "
                f"${rng.choice((15, 20, 25))}. It is valid until {_date(rng)}."),
      ("customer", rng.choice(("ok", "perfect", "thanks"))),
  ]


def _customer_id(rng):
  return f"CU{_digits(rng, 7)}"


def _finance_verify(rng, first, last):
  return _ask_name(rng, first, last) + [
      ("agent", f"Thanks {first}! For security, could you please confirm your "
                "date of birth?"),
      ("customer", f"{_date(rng)} {rng.randint(1950, 2004)}"),
      ("agent", "And your customer ID?"),
      ("customer", _customer_id(rng)),
  ]


def _finance_balance(rng, company, first, last):
  kind = rng.choice(_BANK_ACCOUNTS)
  return [("customer", rng.choice(("i want to check my balance",
                                   f"how much money is in my {kind}",
                                   f"what is my {kind} balance")))
          ] + _finance_verify(rng, first, last) + [
      ("agent", f"Your {kind} balance is ${rng.randint(20, 9800)}.{_digits(rng, 2)} "
                f"as of {_date(rng)}."),
      ("customer", rng.choice(("ok thanks", "great", "that's all i needed"))),
  ]


def _finance_transfer(rng, company, first, last):
  src, dst = rng.sample(_BANK_ACCOUNTS, 2)
  amount = rng.choice((50, 100, 200, 250, 500, 750, 1000, 1500))
  return [("customer", rng.choice((
      f"i want to transfer ${amount} from my {src} to my {dst}",
      f"move {amount} dollars to my {dst} please")))
          ] + _finance_verify(rng, first, last) + [
      ("agent", f"Just to confirm, you'd like to move ${amount} from {src} to "
                f"{dst} today?"),
      ("customer", rng.choice(("yes", "yes please", "correct"))),
      ("agent", f"The transfer is complete. Your reference number is "
                f"TR{_digits(rng, 8)}."),
  ]


def _finance_lost_card(rng, company, first, last):
  address = _public_address(rng)
  return [("customer", rng.choice(("i lost my debit card", "my credit card was stolen",
                                   "i can't find my card")))
          ] + _finance_verify(rng, first, last) + [
      ("agent", f"I've blocked the card ending in {_digits(rng, 4)}. Would you like "
                "a replacement card?"),
      ("customer", rng.choice(("yes please", "yes"))),
      ("agent", "Where should we mail it?"),
      ("customer", rng.choice((address, f"to {address}"))),
      ("agent", f"Your new card will reach {address} by {_date(rng)}."),
  ]


def _finance_dispute(rng, company, first, last):
  amount = _price(rng, 9, 400)
  return [("customer", rng.choice(("there is a charge on my card i don't recognize",
                                   "i was charged twice",
                                   "i want to dispute a transaction")))
          ] + _finance_verify(rng, first, last) + [
      ("agent", "Could you tell me the amount and the date of the charge?"),
      ("customer", f"${amount} on {_date(rng)}"),
      ("agent", f"I've opened a dispute for ${amount}. Your case number is "
                f"DS{_digits(rng, 6)}, and we will update you within 10 days."),
  ]


def _finance_loan(rng, company, first, last):
  amount, years = rng.choice((5000, 10000, 15000, 25000)), rng.choice((2, 3, 5))
  email = _public_email(rng, first)
  yes = rng.random() < 0.6
  turns = [
      ("customer", rng.choice(("what is the interest rate for a personal loan",
                               "i want to apply for a loan"))),
      ("agent", f"Our personal loan rate starts at {rng.randint(6, 14)}.{rng.randint(0, 9)}% "
                f"per year for terms up to {years} years. May I know the amount "
                "you need?"),
      ("customer", f"${amount}"),
      ("agent", f"For ${amount} over {years} years your monthly payment would be "
                f"about ${amount // (12 * years) + rng.randint(15, 90)}. Shall I "
                "start the application?"),
      ("customer", "yes" if yes else "not now, thanks"),
  ]
  if yes:
    turns += _ask_name(rng, first, last) + [
        ("agent", "Where should I send the application form?"),
        ("customer", email),
        ("agent", f"I've emailed the application form to {email}."),
    ]
  return turns


def _license_key(rng):
  return "-".join("".join(rng.choice(_KEY_CHARS) for _ in range(4))
                  for _ in range(4))


def _software_password(rng, company, first, last):
  email = _public_email(rng, first)
  return [
      ("customer", rng.choice(("i forgot my password", "i can't log in to my account",
                               "reset my password please"))),
      ("agent", "Could you please share the email address on your account?"),
      ("customer", rng.choice((email, f"it is {email}"))),
      ("agent", f"I've sent a password reset link to {email}. It will expire in "
                "24 hours."),
      ("customer", rng.choice(("got it, thanks", "ok", "it worked"))),
  ]


def _software_license(rng, company, first, last):
  product = rng.choice(_PRODUCTS)
  return [("customer", rng.choice(("i need my license key",
                                   f"i lost my product key for {product}")))
          ] + _ask_name(rng, first, last) + [
      ("agent", f"Thanks {first}! Could you please share your order ID?"),
      ("customer", _order_number(rng)),
      ("agent", f"Your license key for {product} is {_license_key(rng)}. I've also "
                "sent it to your email."),
  ]


def _software_crash(rng, company, first, last):
  product, device = rng.choice(_PRODUCTS), rng.choice(_DEVICES)
  major = rng.randint(2, 6)
  fixed = rng.random() < 0.5
  return [
      ("customer", rng.choice((f"{product} crashes when i open it",
                               "the app keeps freezing",
                               f"i get an error when i start {product}"))),
      ("agent", "I'm sorry to hear that. Which version are you using and on "
                "which device?"),
      ("customer", f"version {major}.{rng.randint(0, 9)} on my {device}"),
      ("agent", f"Please update to version {major + 1}.{rng.randint(0, 9)}."
                f"{rng.randint(1, 9)} and restart your {device}."),
      ("customer", "it works now" if fixed else "done, still crashing"),
      ("agent", "Glad it works again!" if fixed else
       f"I've opened support ticket TK{_digits(rng, 6)}. Our team will email "
       f"you within {rng.choice((24, 48))} hours."),
  ]


def _software_subscription(rng, company, first, last):
  p1, p2 = rng.sample(_SOFTWARE_PLANS, 2)
  return [
      ("customer", rng.choice((f"i want to upgrade to the {p2.lower()} plan",
                               "i want to change my subscription",
                               f"how much is the {p2.lower()} plan"))),
      ("agent", "May I have the email address on your account?"),
      ("customer", _public_email(rng, first)),
      ("agent", f"You are on the {p1} plan. The {p2} plan costs "
                f"${rng.randint(5, 60)} per month."),
      ("customer", rng.choice(("ok switch me", "yes please change it"))),
      ("agent", f"Done! Your subscription is now on the {p2} plan, starting "
                f"{_date(rng)}."),
  ]


def _software_refund(rng, company, first, last):
  product = rng.choice(_PRODUCTS)
  return [
      ("customer", rng.choice(("i was charged for a renewal i didn't want",
                               f"i want a refund for {product}",
                               "please cancel my renewal"))),
      ("agent", "Could you please share the email address on your account?"),
      ("customer", _public_email(rng, first)),
      ("agent", f"I see a charge of ${_price(rng, 5, 120)} on {_date(rng)} for "
                f"{product}. I've cancelled the renewal and refunded it to the "
                f"card ending in {_digits(rng, 4)}."),
  ]


PUBLIC_INTENTS = {
    "FASTFOOD": (_fastfood_order, _fastfood_status, _fastfood_complaint,
                 _fastfood_store, _fastfood_coupon),
    "FINANCE": (_finance_balance, _finance_transfer, _finance_lost_card,
                _finance_dispute, _finance_loan),
    "SOFTWARE": (_software_password, _software_license, _software_crash,
                 _software_subscription, _software_refund),
}


def render_public(turns: list[tuple[str, str]]) -> str:
  """One conversation as one line, like `multidogo.format_conversation`
  with `domain_tokens=False` but without `<_soc_>` / `<_eoc_>` and with
  `PUBLIC_ROLE_NAMES` for the speaker tokens; utterances are
  whitespace-normalised as the reader does (empty ones dropped)."""
  return " ".join(f"{PUBLIC_ROLE_NAMES[role]} {' '.join(text.split())}"
                  for role, text in turns if text.split())


def _public_corpus_policy() -> redaction.KeywordPolicy:
  """Flags a text holding a phrase of the sample's `keywords.json` (its
  domains) or a word of the sample's entity pools (`PRIVATE_ENTITIES`), as
  whole words in any letter case."""
  entities = [*_FIRST, *_LAST, *_AGENTS, *_MAIL, *_CITIES, *_STREETS, *_CARS,
              *_FLIGHT_CODES.values(),
              *(w for names in COMPANIES.values() for n in names for w in n.split())]
  return redaction.KeywordPolicy({
      **{d: [*COMPANIES[d], *KEYWORDS[d]] for d in SEEDS},
      "PRIVATE_ENTITIES": entities})


def _split_stats(docs: list[str]) -> dict:
  return {"documents": len(docs), "words": sum(len(d.split()) for d in docs),
          "characters": sum(len(d) for d in docs)}


def _public_readme(stats: dict) -> str:
  rows = ["# multidogo_public", "",
          "A public pretraining corpus for the MultiDoGo world: fictional",
          "customer-service conversations of the three MultiDoGo domains that the",
          "private sample (`../multidogo_sample`) lacks, FASTFOOD, FINANCE and",
          "SOFTWARE, written by the sample's generator (same greetings, name",
          "questions, customer casing styles and closings; new intents, companies",
          "and slot pools). Deterministic; regenerate with",
          "",
          "    python -m tasks.multidogo_sample.generate --public_corpus",
          "",
          f"(seed `PUBLIC_SEED` = {stats['seed']}). `train.jsonl` / `validation.jsonl`:",
          "one `{\"text\": conversation}` per line. A conversation is one line, as",
          "the task formats it (`tasks.multidogo`) but without its control tokens",
          "(`<_soc_>`, `<_eoc_>`, domain tokens, and the speaker tokens `SYS:` /",
          "`USR:`, which are extra tokens added at fine-tuning): each utterance is",
          "preceded by `Agent:` or `Customer:` instead. Validation is a random",
          f"{PUBLIC_VALIDATION_FRACTION:.0%} of the conversations; no document is in both splits.",
          "",
          "| split | documents | words | characters |", "| --- | --- | --- | --- |"]
  for split in ("train", "validation"):
    s = stats[split]
    rows.append(f"| {split} | {s['documents']} | {s['words']} | {s['characters']} |")
  rows += ["",
           "Disjoint from the private sample: no phrase of the sample's",
           "`keywords.json` (its AIRLINE / MEDIA / INSURANCE company names and",
           "domain terms, which the keyword redaction policy and the domain",
           "attacks look for), and no word of the sample generator's entity pools",
           "(customer and agent names, cities, streets, e-mail domains, cars,",
           "flight codes, company-name words), occurs in any document, matched as",
           "whole words in any letter case. The public pools are disjoint by",
           "construction, and the generator redraws any conversation that the",
           "keyword policy over those lists flags",
           f"({stats['redrawn']} redrawn for this corpus; {stats['duplicates']} duplicates redrawn).",
           "`tests/dialog/test_multidogo_public_corpus.py` checks it again from",
           "the committed sample files themselves."]
  return "\n".join(rows) + "\n"


def generate_public_corpus(output_dir: str = DEFAULT_PUBLIC_DIR, *,
                           seed: int = PUBLIC_SEED) -> dict:
  """Writes the public corpus (`train.jsonl`, `validation.jsonl`,
  `README.md`) under `output_dir`; returns its statistics."""
  rng = random.Random(seed)
  policy = _public_corpus_policy()
  docs: list[str] = []
  seen: set[str] = set()
  redrawn = duplicates = 0
  while len(docs) < PUBLIC_NUM_CONVERSATIONS:
    domain = PUBLIC_DOMAINS[len(docs) % len(PUBLIC_DOMAINS)]
    doc = render_public(conversation(
        rng, domain, companies=PUBLIC_COMPANIES, intents=PUBLIC_INTENTS,
        first_names=_PUBLIC_FIRST, last_names=_PUBLIC_LAST,
        agents=_PUBLIC_AGENTS))
    # The second view splits digits off letters, so that a name inside an
    # e-mail address ("priya12@...") is a whole word too.
    if policy.flags(doc) or policy.flags(re.sub(r"\d+", r" \g<0> ", doc)):
      redrawn += 1
    elif doc in seen:
      duplicates += 1
    else:
      seen.add(doc)
      docs.append(doc)
  n_valid = max(50, round(PUBLIC_VALIDATION_FRACTION * len(docs)))
  valid_ids = set(rng.sample(range(len(docs)), n_valid))
  splits = {"train": [d for i, d in enumerate(docs) if i not in valid_ids],
            "validation": [d for i, d in enumerate(docs) if i in valid_ids]}
  os.makedirs(output_dir, exist_ok=True)
  for split, split_docs in splits.items():
    text_corpus.write_documents(os.path.join(output_dir, f"{split}.jsonl"),
                                split_docs)
  stats = {"seed": seed, "redrawn": redrawn, "duplicates": duplicates,
           **{split: _split_stats(d) for split, d in splits.items()}}
  with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8",
            newline="\n") as f:
    f.write(_public_readme(stats))
  return stats


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=None,
                      help=f"default {DEFAULT_OUTPUT_DIR} (the sample) or "
                      f"{DEFAULT_PUBLIC_DIR} (--public_corpus)")
  parser.add_argument("--no_vocab", action="store_true",
                      help="skip training the BPE vocabulary (and the README)")
  parser.add_argument("--public_corpus", action="store_true",
                      help="write the public pretraining corpus instead of the sample")
  args = parser.parse_args(argv)
  if args.public_corpus:
    args.output_dir = args.output_dir or DEFAULT_PUBLIC_DIR
    generate_public_corpus(args.output_dir)
  else:
    args.output_dir = args.output_dir or DEFAULT_OUTPUT_DIR
    generate(args.output_dir, train_vocabulary=not args.no_vocab)
  path = os.path.join(args.output_dir, "README.md")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      print(f.read())


if __name__ == "__main__":
  main()
