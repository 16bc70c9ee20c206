"""Text from data, made safe to show on a terminal (pure): the one escaping every human-readable output uses.

Agent names, labels, a server's error text, a failure reason, a path: any of them may hold bytes a terminal acts
on (ESC starts a control sequence; OSC 52 writes the clipboard on many terminals, others retitle the window or
hide text), and bidirectional-override characters make a line read otherwise than it is. Each such character is
shown as its escape, the way Python writes it (`\\x1b`, `\\x9b`, `\\u202e`), so the text stays readable and says
what the data holds. JSON outputs never pass here: they stay exact (a JSON writer escapes the C0 controls itself).
"""

from __future__ import annotations

import re

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}\ud800-\udfff]")
_UNSAFE_KEEPING_LINES = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}\ud800-\udfff]")


_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    c = ord(char)
    return _NAMED.get(char) or (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")


def shown(value: object) -> str:
    """`value` as text with every control, bidirectional-override and lone-surrogate character escaped (newlines
    and tabs too): for one field from data (an agent name, a reason, a path) inside a line."""
    return _UNSAFE.sub(_escape, str(value))


def shown_lines(text: str) -> str:
    """Rendered text (several lines, laid out with newlines and tabs) with every other control character
    escaped: what the command line prints, so nothing a renderer missed reaches the terminal raw."""
    return _UNSAFE_KEEPING_LINES.sub(_escape, text)
