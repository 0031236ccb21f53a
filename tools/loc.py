"""Advisory size report: code lines and tokens per module of onnxtrain, and the change since a git revision.

    python tools/loc.py [--since REV] [--top N]

Counts lines that hold code (no blank lines, comments or docstrings) and Python tokens. A signal for
modules that grew past a screenful of concerns, not a gate: never golf lines to please it.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import token
import tokenize

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def measure(source: str) -> tuple[int, int]:
    """(code lines, tokens) of Python ``source``; docstrings and comments do not count."""
    lines: set[int] = set()
    count = 0
    prev = token.INDENT
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return 0, 0
    for t in toks:
        if t.type in (token.COMMENT, token.NL, token.NEWLINE, token.INDENT, token.DEDENT, token.ENDMARKER):
            if t.type in (token.NEWLINE, token.INDENT, token.DEDENT):
                prev = t.type
            continue
        if t.type == token.STRING and prev in (token.INDENT, token.DEDENT, token.NEWLINE):
            prev = token.STRING  # a statement that is only a string: a docstring
            continue
        prev = t.type
        count += 1
        lines.update(range(t.start[0], t.end[0] + 1))
    return len(lines), count


def files(rev: str | None = None) -> dict[str, str]:
    """Path → source of every module under onnxtrain/, in the work tree or at git revision ``rev``."""
    if rev is None:
        out = {}
        for folder, _, names in os.walk(os.path.join(ROOT, "onnxtrain")):
            for n in names:
                if n.endswith(".py"):
                    p = os.path.join(folder, n)
                    with open(p, encoding="utf-8") as f:
                        out[os.path.relpath(p, ROOT)] = f.read()
        return out
    listing = subprocess.run(["git", "-C", ROOT, "ls-tree", "-r", "--name-only", rev, "onnxtrain"],
                             capture_output=True, text=True, check=True).stdout.split()
    return {p: subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{p}"], capture_output=True, text=True,
                              check=True).stdout for p in listing if p.endswith(".py")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--since", help="also show the change against this git revision")
    ap.add_argument("--top", type=int, default=25, help="modules to list, largest first")
    a = ap.parse_args(argv)
    now = {p: measure(s) for p, s in files().items()}
    before = {p: measure(s) for p, s in files(a.since).items()} if a.since else {}
    rows = sorted(now.items(), key=lambda kv: -kv[1][0])
    print(f"{'module':50s} {'lines':>6s} {'tokens':>7s}" + ("  change" if a.since else ""))
    for p, (n, t) in rows[: a.top]:
        delta = f"  {n - before.get(p, (0, 0))[0]:+d}" if a.since else ""
        print(f"{p:50s} {n:6d} {t:7d}{delta}")
    total = sum(n for n, _ in now.values()), sum(t for _, t in now.values())
    print(f"{'total (' + str(len(now)) + ' modules)':50s} {total[0]:6d} {total[1]:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
