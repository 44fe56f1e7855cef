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

from dpjax.datasets import multidogo
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


def _name(rng):
  return rng.choice(_FIRST), rng.choice(_LAST)


def _email(rng, first):
  return f"{first.lower()}{rng.randint(1, 99)}@{rng.choice(_MAIL)}"


def _card(rng):
  return " ".join(f"{rng.randint(0, 9999):04d}" for _ in range(4))


def _date(rng):
  return f"{rng.choice(_MONTHS)} {rng.randint(1, 28)}"


def _address(rng):
  return f"{rng.randint(2, 980)} {rng.choice(_STREETS)} {rng.choice(_STREET_KINDS)}"


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


def conversation(rng: random.Random, domain: str) -> list[tuple[str, str]]:
  """(authorRole, utterance) of one conversation."""
  company = rng.choice(COMPANIES[domain])
  first, last = _name(rng)
  greeting = ("agent", rng.choice((
      f"Hello! You've reached {company} customer service. How may I help you today?",
      f"Hi there, good morning! Welcome to {company}. You're connected to "
      f"{rng.choice(_AGENTS)}. How may I assist you?",
      f"Thank you for contacting {company}! How can I help you today?")))
  opener = [("customer", rng.choice(("hi", "hai", "hello", "good morning")))]
  turns = (opener + [greeting] if rng.random() < 0.5 else [greeting])
  turns += rng.choice(INTENTS[domain])(rng, company, first, last)
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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR)
  parser.add_argument("--no_vocab", action="store_true",
                      help="skip training the BPE vocabulary (and the README)")
  args = parser.parse_args(argv)
  generate(args.output_dir, train_vocabulary=not args.no_vocab)
  path = os.path.join(args.output_dir, "README.md")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      print(f.read())


if __name__ == "__main__":
  main()
