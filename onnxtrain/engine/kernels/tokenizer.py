"""``com.microsoft`` Tokenizer (onnxruntime's contrib op; inference only): splits each string of a [C] or
[N, C] string tensor into tokens laid along a new last axis, the rows padded with ``pad_value`` to the
longest one. skl2onnx's CountVectorizer and TfidfVectorizer exports tokenize with it.

Exactly one of two modes is set: ``separators``, a list of RE2 patterns cutting the text (applied one after
the other, each to every piece the ones before left), or ``tokenexp``, one RE2 pattern whose matches are the
tokens. ``separators=[""]`` or ``tokenexp="."`` tokenizes code point by code point (newlines too). Pieces and
matches of fewer than ``mincharnum`` code points are dropped; ``mark`` frames each row's tokens with
"\\x02" and "\\x03" (the padding comes after the end mark). What onnxruntime's kernel does is followed where
the op's text is silent:

* patterns match leftmost-longest (RE2's ``longest_match``): ``a|ab`` takes "ab", ``a*?`` as much as it can;
  Python's ``re`` matches leftmost-first, so a pattern not made of single-character atoms under greedy
  quantifiers is stretched to its longest match by a further search (exact, but slower);
* a match of no characters drops the character it stands before (and one at the end of a piece ends it);
  a ``tokenexp`` match that is too short is searched again from its second character. (RE2 searches bytes:
  where an empty separator match falls inside a multi-byte character, as ``\\B`` does in "中" after a
  letter, onnxruntime fails with "Match contains invalid utf8 chars"; here the text is code points, and
  the next match between characters counts);
* no token in any string: the shape is the input's plus a last axis of 0, whatever ``mark`` says; an empty
  input of shape [0] stays [0], of shape [N, C] becomes [N, 0].

Patterns are RE2 syntax run by Python's ``re`` through :func:`onnxtrain.engine.re2.compile_re2`, which
refuses what Python cannot give RE2's meaning (``\\p{L}``, ``\\C``) and what RE2 itself refuses; errors
name the node. Unlike onnxruntime, a node setting both ``separators`` and ``tokenexp`` is refused (the op's
text allows one; onnxruntime uses the separators and ignores the expression).
"""

from __future__ import annotations

import re

import numpy as np

from onnxtrain.engine.kernels.text import _strings
from onnxtrain.engine.re2 import compile_re2
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

MS = "com.microsoft"
START, END = "\x02", "\x03"  # the start-of-text and end-of-text marks

_REPEAT = re.compile(r"\{\d+(?:,\d*)?\}")  # an RE2 counted repetition ("{" starting none is a literal)
_FLAG_GROUP = re.compile(r"\(\?[imsU-]*\)")  # (?i): sets flags, matches nothing
_LEADING_FLAGS = re.compile(r"(?:\(\?[aiLmsux]+\))+")  # Python's global inline flags opening a pattern


def _class_end(p: str, i: int) -> int:
    """The index past the RE2 bracket expression opening at ``p[i] == "["``."""
    j = i + 1
    j += p.startswith("^", j)
    j += p.startswith("]", j)  # a "]" first is a literal
    while j < len(p):
        if p.startswith("[:", j) and p.find(":]", j + 2) > 0:
            j = p.find(":]", j + 2) + 2
        elif p[j] == "\\":
            j += 2
        elif p[j] == "]":
            return j + 1
        else:
            j += 1
    return j


def _first_is_longest(p: str) -> bool:
    """Whether Python's leftmost-first match of the RE2 pattern ``p`` is always its leftmost-longest one: a
    run of single characters (literals, escapes, classes, ``.``) and zero-width assertions, each at most
    greedily repeated; no alternation, no group but a flag setting, no lazy quantifier, no ``\\Q``. A
    greedy first match of such a run cannot be lengthened. False only costs a further search."""
    i, repeated = 0, False
    while i < len(p):
        c = p[i]
        counted = _REPEAT.match(p, i) if c == "{" else None
        if c in "*+?" or counted:
            if repeated:  # a lazy quantifier (a*?, a??), or a repeat of a repeat
                return False
            repeated = True
            i = counted.end() if counted else i + 1
            continue
        repeated = False
        if c == "\\":
            if p.startswith("Q", i + 1):
                return False
            close = p.find("}", i) if p.startswith("x{", i + 1) else -1
            i = close + 1 if close > 0 else i + 2
        elif c == "[":
            i = _class_end(p, i)
        elif c == "(":
            flags = _FLAG_GROUP.match(p, i)
            if not flags:
                return False
            i = flags.end()
        elif c in "|)":
            return False
        else:
            i += 1
    return True


class _Pattern:
    """One RE2 pattern of a node, searched leftmost-longest as onnxruntime's RE2 (``longest_match``) does."""

    def __init__(self, pattern: str, what: str, op: str):
        try:
            self.rx = compile_re2(pattern)
        except ValueError as e:
            raise ValueError(f"{op}: {what}: {str(e).removeprefix('RegexFullMatch: ')}") from None
        self.greedy_is_longest = _first_is_longest(pattern)
        # for the longer-match search: the translated pattern without its opening global flags (they are in
        # rx.flags), to be grouped and followed by a bound on what may remain after the match
        flags = _LEADING_FLAGS.match(self.rx.pattern)
        self._body = self.rx.pattern[flags.end() if flags else 0 :]
        self._ending: dict[int, re.Pattern[str]] = {}

    def _ends_within(self, k: int) -> re.Pattern[str]:
        """The pattern, matching only where at most ``k`` characters of the text remain after the match."""
        rx = self._ending.get(k)
        if rx is None:
            if len(self._ending) >= 256:
                self._ending.clear()
            rx = self._ending[k] = re.compile(f"(?:{self._body})(?!(?s:.){{{k + 1}}})", self.rx.flags)
        return rx

    def search(self, text: str, pos: int) -> tuple[int, int] | None:
        """(start, end) of the leftmost-longest match in ``text`` starting at ``pos`` or later, or None. Both
        ways of matching find the same leftmost start; from there, while a match ending further exists, take
        it."""
        m = self.rx.search(text, pos)
        if m is None:
            return None
        start, end = m.span()
        if not self.greedy_is_longest:
            while end < len(text):
                longer = self._ends_within(len(text) - end - 1).match(text, start)
                if longer is None:
                    break
                end = longer.end()
        return start, end


class _Tokenizer:
    """A Tokenizer node's attributes, checked as onnxruntime checks them when it loads the node."""

    def __init__(self, attrs: Attrs):
        self.op = op = f"Tokenizer {attrs.name!r}"
        for name in ("mark", "pad_value", "mincharnum"):
            if attrs.get(name) is None:
                raise ValueError(f"{op}: the {name} attribute is required")
        self.mark = bool(attrs["mark"])
        self.pad = attrs["pad_value"]
        self.least = int(attrs["mincharnum"])
        if self.least < 1:
            raise ValueError(f"{op}: mincharnum must be positive, got {self.least}")
        seps, exp = attrs.get("separators"), attrs.get("tokenexp")
        if seps is not None and exp is not None:
            raise ValueError(f"{op}: separators and tokenexp are both set; the op takes exactly one of them")
        if seps is None and exp is None:
            raise ValueError(f"{op}: one of the separators and tokenexp attributes is required")
        if seps is not None and not seps:
            raise ValueError(f"{op}: separators must hold at least one pattern")
        if exp is not None and not exp:
            raise ValueError(f"{op}: tokenexp must not be empty")
        self.by_char = seps == [""] or exp == "."
        if self.by_char and self.least > 1:
            raise ValueError(f"{op}: mincharnum {self.least} is too big for tokenizing by characters "
                             f"(separators [''] or tokenexp '.'), which makes tokens of one character")
        self.separators: list[_Pattern] = []
        self.tokenexp: _Pattern | None = None
        if self.by_char:
            return
        if seps is not None:
            self.separators = [_Pattern(s, "separators", op) for s in seps]
        else:
            self.tokenexp = _Pattern(exp, "tokenexp", op)

    def tokens(self, s: str) -> list[str]:
        if self.by_char:
            return list(s)
        if self.tokenexp is not None:
            return self._matches(s, self.tokenexp)
        pieces = [s]
        for sep in self.separators:
            pieces = [t for piece in pieces for t in self._split(piece, sep)]
        return pieces

    def _matches(self, s: str, rx: _Pattern) -> list[str]:
        """The matches of ``rx`` in ``s``, scanned left to right; one too short is dropped and the search
        goes on from its second character."""
        out: list[str] = []
        pos = 0
        while pos <= len(s):
            hit = rx.search(s, pos)
            if hit is None:
                break
            a, b = hit
            if b - a >= self.least:
                out.append(s[a:b])
                pos = b
            else:
                pos = a + 1
        return out

    def _split(self, s: str, sep: _Pattern) -> list[str]:
        """The pieces of ``s`` between the matches of ``sep``, those long enough. A match of no characters
        drops the character after it (onnxruntime steps over it); at the end of ``s`` it ends the piece."""
        out: list[str] = []
        pos = 0
        while True:
            hit = sep.search(s, pos)
            if hit is None:
                if len(s) - pos >= self.least:
                    out.append(s[pos:])
                return out
            a, b = hit
            if a - pos >= self.least:
                out.append(s[pos:a])
            pos = b if b > a else a + 1
            if pos > len(s):
                return out


@kernel("Tokenizer", domain=MS)
def tokenizer(inputs: Inputs, attrs: Attrs) -> Outputs:
    tok: _Tokenizer = attrs.cached("tokenizer", lambda: _Tokenizer(attrs))
    x = _strings(inputs[0], tok.op)
    if x.ndim not in (1, 2):
        raise ValueError(f"{tok.op}: the input must have shape [C] or [N, C], got {list(x.shape)}")
    if x.size == 0:  # onnxruntime: [0] stays [0]; [N, C] with N or C of 0 gives [N, 0]
        return (np.empty((*x.shape[:-1], 0), dtype=object),)
    rows = [tok.tokens(s) for s in x.flat]
    most = max(map(len, rows))
    if most == 0:  # no string has a token: no marks either
        return (np.empty((*x.shape, 0), dtype=object),)
    width = most + 2 * tok.mark
    y = np.full((len(rows), width), tok.pad, dtype=object)
    for out, row in zip(y, rows):
        if tok.mark:
            out[0], out[len(row) + 1] = START, END
            out[1 : len(row) + 1] = row
        else:
            out[: len(row)] = row
    return (y.reshape(*x.shape, width),)
