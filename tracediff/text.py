"""Text read from a trace (names, requests, metadata) is data: these helpers keep it from acting as
terminal escapes, rich markup (callers put it in ``rich.text.Text``, never in markup strings) or
Markdown."""

from __future__ import annotations

import logging
from typing import Any


def safe(text: Any) -> str:
    """Trace text with control characters (terminal escapes, newlines) shown as escapes."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class DataOnly(logging.Filter):
    """Installed on the ``tracediff`` logger: a warning's text (file names, tensor names, messages
    from other libraries) reaches the terminal as data, one line, whatever handler prints it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.isprintable():
            record.msg, record.args = safe(message), None
        return True


MARKDOWN_SPECIAL = "\\`*_[]<>&|#"


WORD_JOINER = "\u2060"  # invisible; after "@" it keeps GitHub from reading a mention


def md(text: Any) -> str:
    """Trace text in Markdown prose: no markup, no HTML, no table breaks, no @mention (GitHub links
    mentions in rendered text, so escaping the "@" would not stop one: a word joiner does)."""
    escaped = "".join("\\" + c if c in MARKDOWN_SPECIAL else c for c in safe(text))
    return escaped.replace("@", "@" + WORD_JOINER)


def code(text: Any) -> str:
    """Trace text as a Markdown code span, whatever backticks it holds."""
    text = safe(text)
    if "`" not in text:
        return f"`{text}`"
    fence = "``"
    while fence in text:
        fence += "`"
    return f"{fence} {text} {fence}"
