"""Lispress: the s-expression language of SMCalFlow and TreeDST programs.

Syntax (Microsoft's dataflow release, Lispress 2.0, and the 1.0 literals it
still accepts):

* a list `(f a b ...)`: a call of `f` (possibly with `:name value` named
  arguments), or one of the special forms `let`, `do`, `lambda`;
* a symbol: a name (`Yield`, `Event.start_?`, `?=`, `&`, `x0`, `:object`) or
  a number/boolean literal (`3L`, `2.5`, `true`);
* a string `"..."` with JSON escapes;
* `^T e`: the type `T` (a symbol or a list) ascribed to the form `e`; in the
  head of a list it gives type arguments: `(^(Event) EmptyStructConstraint)`;
* `#(Type "value")`: a Lispress 1.0 literal value, e.g. `#(PersonName "Kim")`.

Parsed programs are plain immutable values: `Sym`, `Str`, `Meta`, `Literal`
and tuples (lists), so they compare with `==` and hash. Three text forms:

* `render`: the compact one-line form of the published `.jsonl` files,
  `(Yield (^(Event) EmptyStructConstraint))`;
* `linearize`: the same tokens separated by single spaces,
  `( Yield ( ^ ( Event ) EmptyStructConstraint ) )`, so that a byte-level BPE
  sees every parenthesis and name as its own word (the form the language
  models read and write);
* `parse` reads both (whitespace between tokens is free), hence
  `parse(render(p)) == parse(linearize(p)) == p` for every program `p`, and
  `linearize(parse(s)) == s` for every linearized `s`.

Function types (the paper's "set of unique, discrete node labels in the parse
tree, corresponding to API methods"): the names of called functions and
constructors, i.e. the symbol in the head of each list that is a call (for a
head with type arguments, `(^(T) f ...)`, the name `f`). Not function types:
the special forms `let`, `do`, `lambda` and their binding lists; variables;
named-argument keywords; literals (numbers, booleans, strings, `#(...)`
values); type annotations. Nullary calls such as `(Now)` or
`(PlaceFeature.OutdoorDining)` are calls, so they count; Lispress 1.0's
sugared field access `(:start e)` counts under its head `:start`.

Pure Python: no TensorFlow, no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Iterator, Union


@dataclasses.dataclass(frozen=True)
class Sym:
  """A bare symbol: a name, a keyword (`:object`) or a number/boolean."""

  name: str


@dataclasses.dataclass(frozen=True)
class Str:
  """A string literal; `value` is the decoded text (no quotes, no escapes)."""

  value: str


@dataclasses.dataclass(frozen=True)
class Meta:
  """`^meta expr`: a type ascription, or type arguments in a list's head."""

  meta: "Sexp"
  expr: "Sexp"


@dataclasses.dataclass(frozen=True)
class Literal:
  """`#(Type "value")`: a Lispress 1.0 literal value."""

  form: tuple


Sexp = Union[Sym, Str, Meta, Literal, tuple]

SPECIAL_FORMS = ("let", "do", "lambda")


class LispressError(ValueError):
  """A program that is not well-formed Lispress; says where and why."""


# One token per match, after optional whitespace: a parenthesis, the meta or
# literal marker, a complete string, a symbol, or (last) any other character,
# which can only be the quote of an unterminated string. Every non-space
# character matches, so finditer never skips text (only trailing spaces).
_TOKEN = re.compile(
    r'\s*(?:(?P<punct>[()^#])|(?P<string>"(?:[^"\\]|\\.)*")'
    r'|(?P<symbol>[^\s()^#"]+)|(?P<bad>\S))', re.DOTALL)


def _tokenize(text: str) -> list[tuple[str, str, int]]:
  """`(kind, text, position)` of each token; kind is punct/string/symbol."""
  tokens = []
  for m in _TOKEN.finditer(text):
    kind = m.lastgroup
    if kind == "bad":
      raise LispressError(
          f"unterminated string starting at character {m.start(kind) + 1}")
    tokens.append((kind, m.group(kind), m.start(kind) + 1))
  return tokens


class _Parser:
  """Recursive descent over the token list (programs are shallow)."""

  def __init__(self, text: str):
    self.tokens = _tokenize(text)
    self.i = 0

  def _operand(self, marker: str, pos: int, example: str) -> Sexp:
    """The form after a `^` or `#` marker; it must exist."""
    if self.i >= len(self.tokens) or self.tokens[self.i][1] == ")":
      raise LispressError(
          f"{marker!r} at character {pos} is missing a form, as in {example}")
    return self.form()

  def form(self) -> Sexp:
    """The form starting at the current token (callers check there is one)."""
    kind, tok, pos = self.tokens[self.i]
    self.i += 1
    # Symbols and strings never equal a punctuation token (see _TOKEN).
    if kind == "symbol":
      return Sym(tok)
    if kind == "string":
      try:
        return Str(json.loads(tok))
      except json.JSONDecodeError as e:
        raise LispressError(f"bad string at character {pos}: {e.msg}") from e
    if tok == "(":
      items = []
      while self.i < len(self.tokens) and self.tokens[self.i][1] != ")":
        items.append(self.form())
      if self.i == len(self.tokens):
        raise LispressError(f"'(' at character {pos} is never closed")
      self.i += 1
      return tuple(items)
    if tok == ")":
      raise LispressError(f"unbalanced ')' at character {pos}")
    if tok == "^":
      example = "^(Event) EmptyStructConstraint"
      return Meta(self._operand("^", pos, example),
                  self._operand("^", pos, example))
    literal = self._operand("#", pos, '#(String "lunch")')  # tok == "#"
    if not isinstance(literal, tuple):
      raise LispressError(f"'#' at character {pos} must be followed by a list, "
                          'as in #(String "lunch")')
    return Literal(literal)


def parse(text: str) -> Sexp:
  """Parses one Lispress program (compact, pretty-printed or linearized).

  Raises:
    LispressError: empty text, unbalanced parentheses, an unterminated string
      or bad escape, a dangling `^` or `#`, or more than one top-level form;
      the message gives the character position; or nesting deeper than
      Python's recursion limit (real programs nest a few dozen levels).
  """
  parser = _Parser(text)
  if not parser.tokens:
    raise LispressError("empty program")
  try:
    program = parser.form()
  except RecursionError:
    raise LispressError("program nested too deeply") from None
  if parser.i < len(parser.tokens):
    _, tok, pos = parser.tokens[parser.i]
    if tok == ")":
      raise LispressError(f"unbalanced ')' at character {pos}")
    raise LispressError(
        f"expected one program, found another form at character {pos}")
  return program


def _as_program(program: str | Sexp) -> Sexp:
  return parse(program) if isinstance(program, str) else program


def _tokens(x: Sexp) -> Iterator[str]:
  """The program's tokens in order (strings JSON-encoded)."""
  if isinstance(x, tuple):
    yield "("
    for item in x:
      yield from _tokens(item)
    yield ")"
  elif isinstance(x, Sym):
    yield x.name
  elif isinstance(x, Str):
    yield json.dumps(x.value, ensure_ascii=False)
  elif isinstance(x, Meta):
    yield "^"
    yield from _tokens(x.meta)
    yield from _tokens(x.expr)
  elif isinstance(x, Literal):
    yield "#"
    yield from _tokens(x.form)
  else:
    raise TypeError(f"not a Lispress form: {x!r}")


def render(program: str | Sexp) -> str:
  """The compact one-line form used by the dataflow `.jsonl` files."""
  out = []
  previous = "("
  for tok in _tokens(_as_program(program)):
    if tok != ")" and previous not in ("(", "^", "#"):
      out.append(" ")
    out.append(tok)
    previous = tok
  return "".join(out)


def linearize(program: str | Sexp) -> str:
  """Tokens separated by single spaces; `parse` is its exact inverse."""
  return " ".join(_tokens(_as_program(program)))


def _head_name(head: Sexp) -> str | None:
  """The called name of a list head: `f` or `^(T...) f`; None otherwise."""
  if isinstance(head, Meta):
    head = head.expr
  return head.name if isinstance(head, Sym) else None


def _walk_calls(x: Sexp, out: list[str]) -> None:
  if isinstance(x, Meta):
    _walk_calls(x.expr, out)  # the type in x.meta is not a call
    return
  if not isinstance(x, tuple) or not x:
    return  # symbols, strings, #(...) literals, ()
  name = _head_name(x[0])
  if name == "let":
    if len(x) < 3 or not isinstance(x[1], tuple) or len(x[1]) % 2:
      raise LispressError("let needs a list of (variable value ...) pairs "
                          f"and a body, got {render(x)[:80]!r}")
    variables, values = x[1][0::2], x[1][1::2]
    if not all(isinstance(v, Sym) for v in variables):
      raise LispressError(f"let variables must be symbols, got {render(x[1])[:80]!r}")
    body = values + x[2:]
  elif name == "lambda":
    if len(x) < 3 or not isinstance(x[1], tuple):
      raise LispressError("lambda needs a parameter list and a body, got "
                          f"{render(x)[:80]!r}")
    body = x[2:]
  elif name == "do":
    body = x[1:]
  else:
    if name is None:
      _walk_calls(x[0], out)  # e.g. a computed head ((f x) y)
    else:
      out.append(name)
    body = x[1:]
  for item in body:
    _walk_calls(item, out)


def function_calls(program: str | Sexp) -> list[str]:
  """The function type of every call in the program, pre-order, with repeats.

  The bag of API nodes (for counts, chi-square distances, API
  precision/recall); see the module docstring for what counts as a call.

  Raises:
    LispressError: a text program does not parse, or a `let`/`lambda` form is
      malformed.
  """
  out: list[str] = []
  _walk_calls(_as_program(program), out)
  return out


def function_types(program: str | Sexp) -> list[str]:
  """The distinct function types of the program, in first-call order."""
  return list(dict.fromkeys(function_calls(program)))


def symbols(program: str | Sexp) -> Iterator[str]:
  """Every symbol's name in pre-order, types and literal parts included."""
  stack = [_as_program(program)]
  while stack:
    x = stack.pop()
    if isinstance(x, Sym):
      yield x.name
    elif isinstance(x, tuple):
      stack.extend(reversed(x))
    elif isinstance(x, Meta):
      stack.extend((x.expr, x.meta))
    elif isinstance(x, Literal):
      stack.append(x.form)


__all__ = [
    "Sym", "Str", "Meta", "Literal", "Sexp", "SPECIAL_FORMS", "LispressError",
    "parse", "render", "linearize", "function_calls", "function_types",
    "symbols",
]
