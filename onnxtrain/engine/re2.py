"""RE2 patterns (the syntax of ONNX's RegexFullMatch) run by Python's ``re``.

A pattern is translated to Python's syntax with RE2's meaning (Unicode mode, whose case-insensitive
matching folds like RE2's but for the Turkish dotted and dotless i): ``\\d``, ``\\w``, ``\\s``, ``\\b`` and
the POSIX classes ``[[:alpha:]]`` are ASCII, ``$`` matches at the end of the text only, ``a{,3}`` is
literal, and ``\\z``, ``\\x{...}``, ``\\Q...\\E``, ``(?<name>...)``, octal escapes (``\\12``, ``\\141``),
repeated anchors (``^*``) and the ungreedy flag ``U`` (which changes no full match, so it is dropped) are
read. What Python cannot run (``\\p{L}`` classes, ``\\C``), and what RE2 refuses but Python would run
(backreferences, lookaround, atomic groups, possessive quantifiers), is refused with an error naming the
pattern.
"""

from __future__ import annotations

import re
import warnings

# RE2's Perl and POSIX classes are ASCII: as Python class items ("" for none), and complemented
_PERL = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\f\\r "}
_POSIX = {"alnum": "0-9A-Za-z", "alpha": "A-Za-z", "ascii": "\\x00-\\x7f", "blank": "\\t ",
          "cntrl": "\\x00-\\x1f\\x7f", "digit": "0-9", "graph": "!-~", "lower": "a-z", "print": " -~",
          "punct": "!-/:-@\\[-`{-~", "space": "\\t\\n\\v\\f\\r ", "upper": "A-Z", "word": "0-9A-Za-z_",
          "xdigit": "0-9A-Fa-f"}
_W = "[0-9A-Za-z_]"  # a word boundary's classes do not fold case (the Kelvin sign is no word character)
_BOUNDARY = {"b": f"(?-i:(?<={_W})(?!{_W})|(?<!{_W})(?={_W}))",
             "B": f"(?-i:(?<={_W})(?={_W})|(?<!{_W})(?!{_W}))"}


# what Python's re runs and RE2 refuses (onnxruntime's RegexFullMatch fails on such a pattern)
_NOT_RE2 = ("(?=", "(?!", "(?<=", "(?<!", "(?P=", "(?>")
_REPEAT_END = re.compile(r"\{\d+(,\d*)?\}$")  # a pattern so far ending in a counted repetition
_REPEAT = re.compile(r"[*+?]|\{\d+(,\d*)?\}")  # a quantifier
_FLAGS = re.compile(r"\(\?([a-zA-Z]*)(?:-([a-zA-Z]*))?([:)])")  # a flag group: (?flags) or (?flags:
_OCTAL = re.compile(r"[0-7]{1,3}")


def _anchor(token: str, p: str, end: int) -> str:
    """An anchor's translation, grouped when a quantifier follows it at ``p[end]`` (RE2 repeats an anchor,
    Python's re refuses to)."""
    return f"(?:{token})" if _REPEAT.match(p, end) else token


def _without_ungreedy(m: re.Match[str]) -> str:
    """A flag group without RE2's U (ungreedy) flag, or "" when nothing is left of it."""
    on, off = m.group(1).replace("U", ""), (m.group(2) or "").replace("U", "")
    if m.group(3) == ")" and not on and not off:
        return ""
    return f"(?{on}{'-' + off if off else ''}{m.group(3)}"


class _Unsupported(Exception):
    pass


def _hex_escape(p: str, i: int) -> tuple[str, int]:
    """RE2's ``\\x{HHHH}`` at ``p[i]`` (the ``x``): the code point escaped for Python, and the index
    past it."""
    close = p.find("}", i)
    try:
        return re.escape(chr(int(p[i + 2 : close], 16))), close + 1
    except ValueError:
        raise _Unsupported(f"bad escape {p[i - 1 : close + 1]!r}") from None


def _class(p: str, i: int) -> tuple[str, int]:
    """The bracket expression starting at ``p[i] == "["`` as Python syntax, and the index past it. A Perl or
    POSIX class complemented inside it (``[^\\W]``, ``[[:^alpha:]]``) becomes lookarounds."""
    i += 1
    negated = p.startswith("^", i)
    i += negated
    items, outside = [], []  # outside: the class item lists of complemented members
    first = True
    while True:
        if i >= len(p):
            raise _Unsupported("missing ]")
        c = p[i]
        if c == "]" and not first:
            i += 1
            break
        first = False
        if c == "[" and p.startswith("[:", i):
            close = p.find(":]", i + 2)
            name = p[i + 2 : close] if close > 0 else ""
            neg = name.startswith("^")
            if name.lstrip("^") not in _POSIX:
                raise _Unsupported(f"unknown POSIX class {p[i : close + 2]!r}")
            (outside if neg else items).append(_POSIX[name.lstrip("^")])
            i = close + 2
        elif c == "\\" and i + 1 < len(p):
            e = p[i + 1]
            if e in "dws":
                items.append(_PERL[e])
            elif e in "DWS":
                outside.append(_PERL[e.lower()])
            elif e == "x" and p.startswith("{", i + 2):
                esc, i = _hex_escape(p, i + 1)
                items.append(esc)
                continue
            elif e in "pPQEC":
                raise _Unsupported(f"\\{e} in a character class")
            else:
                items.append(p[i : i + 2])
            i += 2
        else:
            items.append("\\" + c if c in "[]^&~|" else c)  # literal wherever the items are put
            i += 1
    body = "".join(items)
    if not outside:
        return f"[{'^' if negated else ''}{body}]", i
    if negated:  # in none of the items and in every complemented member's class
        return "(?:" + "".join([f"(?![{body}])" if body else "", *(f"(?=[{o}])" for o in outside[1:]),
                                f"[{outside[0]}]"]) + ")", i
    return "(?:" + "|".join(([f"[{body}]"] if body else []) + [f"[^{o}]" for o in outside]) + ")", i


def _translate_re2(p: str) -> str:
    """An RE2 pattern as a Python ``re`` pattern of the same meaning (compiled in Unicode mode, whose case
    folding is close to RE2's): ASCII Perl, POSIX and word-boundary classes, ``$`` at the end of the text
    only (unless a multi-line flag is set), ``\\z``, ``\\x{...}``, ``\\Q...\\E``, ``(?<name>``, and ``{``
    that starts no repetition (``a{,3}``) as a literal."""
    multiline = re.search(r"\(\?[a-zA-Z]*m", p) is not None
    out: list[str] = []
    i = 0
    while i < len(p):
        c = p[i]
        if c == "\\" and i + 1 < len(p):
            e = p[i + 1]
            if e in "dDwWsS":
                out.append(f"[{'^' if e.isupper() else ''}{_PERL[e.lower()]}]")
            elif e in "bB":
                out.append(_BOUNDARY[e])
            elif e in "zA":
                out.append(_anchor("\\Z" if e == "z" else "\\A", p, i + 2))
            elif e == "x" and p.startswith("{", i + 2):
                esc, i = _hex_escape(p, i + 1)
                out.append(esc)
                continue
            elif e == "Q":
                close = p.find("\\E", i + 2)
                close = len(p) if close < 0 else close
                out.append(re.escape(p[i + 2 : close]))
                i = close + 2
                continue
            elif e in "pPCZ":
                raise _Unsupported(f"\\{e}")
            elif e in "01234567" and (e == "0" or p[i + 2 : i + 3] in tuple("01234567")):
                digits = _OCTAL.match(p, i + 1).group()  # RE2's octal escape: up to three digits
                out.append(re.escape(chr(int(digits, 8))))
                i += 1 + len(digits)
                continue
            elif e in "123456789":  # RE2 has no backreferences (Python would run one)
                raise _Unsupported(f"\\{e}: a backreference, which RE2 refuses")
            else:
                out.append(p[i : i + 2])
            i += 2
        elif c == "[":
            cls, i = _class(p, i)
            out.append(cls)
        elif c in "^$":
            out.append(_anchor("\\Z" if c == "$" and not multiline else c, p, i + 1))
            i += 1
        elif c == "(" and (flags := _FLAGS.match(p, i)) is not None and "U" in flags.group(0):
            out.append(_without_ungreedy(flags))
            i = flags.end()
        elif c == "{" and not re.match(r"\{\d+(,\d*)?\}", p[i:]):
            out.append("\\{")
            i += 1
        elif any(p.startswith(t, i) for t in _NOT_RE2):
            raise _Unsupported(f"{p[i:i + 4]!r}: lookaround, atomic groups and named backreferences, which "
                               "RE2 refuses")
        elif p.startswith("+", i + 1) and (c in "*+?" or c == "}" and _REPEAT_END.search(p[:i + 1])):
            raise _Unsupported(f"{c}+: a possessive quantifier, which RE2 refuses")
        elif p.startswith("(?<", i) and i + 3 < len(p) and p[i + 3] not in "=!":
            out.append("(?P<")
            i += 3
        else:
            out.append(c)
            i += 1
    return "".join(out)


def compile_re2(pattern: str | None) -> re.Pattern[str]:
    """An RE2 ``pattern`` as a Python regex, or ValueError naming what Python lacks."""
    if pattern is None:
        raise ValueError("RegexFullMatch: the pattern attribute is required")
    unsupported = ("RE2-only constructs such as \\p{L} or \\C are not supported (nor \\Z, which RE2 lacks)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # re warns on "[[" or "--" in a class
        try:
            return re.compile(_translate_re2(pattern))
        except FutureWarning as w:
            raise ValueError(
                f"RegexFullMatch: pattern {pattern!r} would mean something else to Python's re than to RE2 "
                f"({w})"
            ) from None
        except (re.error, _Unsupported) as e:
            raise ValueError(
                f"RegexFullMatch: pattern {pattern!r} cannot be compiled by Python's re, which runs the "
                f"op's RE2 syntax ({e}); {unsupported}"
            ) from None
