"""Write :mod:`pgbroker._broker_sync` (the threaded ``Broker``) from :mod:`pgbroker._broker_async` (``AsyncBroker``),
and :mod:`pgbroker._primitives_sync` (``Lock``, ``Semaphore``, ``KV``, ``Counter``, ``RateLimiter``) from
:mod:`pgbroker._primitives_async`.

    python3 -m pgbroker._gen_sync            # rewrite pgbroker/_broker_sync.py and pgbroker/_primitives_sync.py
    python3 -m pgbroker._gen_sync --check    # exit 1 if one is not what its source gives

A plain text transformation, line by line, in this order:

1. the source's module docstring is replaced by :data:`HEADER`;
2. ``if True:  # ASYNC`` blocks: the ``if`` branch is dropped and the
   ``else:`` branch (if any) kept, one level less indented;
3. a line ending in ``# ASYNC`` is dropped; a line ending in ``# sync: CODE``
   becomes ``CODE`` (same indentation);
4. the :data:`RENAMES` (for the primitives, :data:`PRIMITIVE_RENAMES` first)
   are applied to every line (code, comments, docstrings).

So the async file stays ordinary, linted, type-checked Python, and the
synchronous one is exactly what it says, with no runtime magic.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_broker_async.py"
TARGET = HERE / "_broker_sync.py"

HEADER = '''\
# Generated from pgbroker/_broker_async.py by `python3 -m pgbroker._gen_sync`: do not edit.
# Change the async source and run the generator; tests/test_broker.py checks that the two agree.
"""The threaded broker, :class:`Broker`, generated from :mod:`pgbroker._broker_async`."""
'''

# (pattern, replacement), applied in this order.
RENAMES: list[tuple[str, str]] = [
    (r"\bAsyncBroker\b", "Broker"),
    (r"\bpsycopg\.AsyncConnection\b", "psycopg.Connection"),
    (r"\bpsycopg\.AsyncCursor\b", "psycopg.Cursor"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\basync (def|with|for) ", r"\1 "),
    (r"\bawait ", ""),
    (r"\basyncio\.Lock\b", "threading.Lock"),
    (r"\basyncio\.Semaphore\b", "threading.Semaphore"),
    (r"\basync_run_broker\b", "run_broker"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"\b_broker_async\b", "_broker_sync"),
]

PRIMITIVES_SOURCE = HERE / "_primitives_async.py"
PRIMITIVES_TARGET = HERE / "_primitives_sync.py"

PRIMITIVES_HEADER = '''\
# Generated from pgbroker/_primitives_async.py by `python3 -m pgbroker._gen_sync`: do not edit.
# Change the async source and run the generator; tests/test_primitives.py checks that the two agree.
"""The coordination primitives for threads, generated from :mod:`pgbroker._primitives_async`."""
'''

# Applied before RENAMES to the primitives.
PRIMITIVE_RENAMES: list[tuple[str, str]] = [
    (r"\bAsync(Lock|Semaphore|KV|Counter|RateLimiter)\b", r"\1"),
    (r"\basync_lock\b", "lock"),
    (r"\b_primitives_async\b", "_primitives_sync"),
]

_ASYNC_IF = re.compile(r"^( *)if True:  # ASYNC$")
_ASYNC_LINE = re.compile(r"  # ASYNC$")
_SYNC_LINE = re.compile(r"^( *)\S.*?  # sync: (.+)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """Index after the last line, from ``start``, that is indented deeper than ``indent`` (blank lines between)."""
    end = i = start
    while i < len(lines):
        if lines[i].strip():
            if _indent(lines[i]) <= indent:
                break
            end = i + 1
        i += 1
    return end


def _drop_docstring(text: str) -> str:
    if not text.startswith('"""'):
        raise ValueError("the async source must start with its module docstring")
    return text[text.index('"""', 3) + 3 :].lstrip("\n")


def generate(source: str, header: str = HEADER, renames: list[tuple[str, str]] = RENAMES) -> str:
    """The synchronous module for the text of the async one (by default the broker's)."""
    lines = _drop_docstring(source).split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        block = _ASYNC_IF.match(line)
        if block:
            indent = len(block.group(1))
            i = _block_end(lines, i + 1, indent)
            if i < len(lines) and lines[i] == " " * indent + "else:":
                end = _block_end(lines, i + 1, indent)
                out.extend(branch[4:] for branch in lines[i + 1 : end])
                i = end
            continue
        i += 1
        if _ASYNC_LINE.search(line):
            continue
        sync = _SYNC_LINE.match(line)
        out.append(sync.group(1) + sync.group(2) if sync else line)
    text = "\n".join(out)
    for pattern, replacement in renames:
        text = re.sub(pattern, replacement, text)
    return header + "\n" + text


def generate_primitives(source: str) -> str:
    """The synchronous primitives for the text of :mod:`pgbroker._primitives_async`."""
    return generate(source, PRIMITIVES_HEADER, PRIMITIVE_RENAMES + RENAMES)


EVENTS_SOURCE = HERE / "_events_async.py"
EVENTS_TARGET = HERE / "_events_sync.py"

EVENTS_HEADER = '''\
# Generated from pgbroker/_events_async.py by `python3 -m pgbroker._gen_sync`: do not edit.
# Change the async source and run the generator; tests/test_events.py checks that the two agree.
"""Lease and registry events for threads, generated from :mod:`pgbroker._events_async`."""
'''

# Applied before RENAMES to the events.
EVENTS_RENAMES: list[tuple[str, str]] = [
    (r"\basync_(observe|registry_feed)\b", r"\1"),
    (r"\b_events_async\b", "_events_sync"),
]


def generate_events(source: str) -> str:
    """The synchronous events module for the text of :mod:`pgbroker._events_async`."""
    return generate(source, EVENTS_HEADER, EVENTS_RENAMES + RENAMES)


# (source, target, generator) of every generated module.
PAIRS = [
    (SOURCE, TARGET, generate),
    (PRIMITIVES_SOURCE, PRIMITIVES_TARGET, generate_primitives),
    (EVENTS_SOURCE, EVENTS_TARGET, generate_events),
]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    status = 0
    for source, target, make in PAIRS:
        wanted = make(source.read_text())
        if not args:
            target.write_text(wanted)
        elif not target.exists() or target.read_text() != wanted:
            print(f"{target} is out of date: run python3 -m pgbroker._gen_sync", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
