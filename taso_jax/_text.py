"""Messages for users: an error from a library, on one line of bounded length."""

from __future__ import annotations


def one_line(message: str, width: int = 300) -> str:
    """``message`` on one line of at most ``width`` characters.

    Lines are joined with " / ". A traceback inside the message (JAX wraps a failed
    callback's in its own error) is cut down to its last line, the error itself. A longer
    text is cut at the last space before the limit and ends with "...".
    """
    head, sep, trace = str(message).partition("Traceback (most recent call last)")
    lines = [ln.strip() for ln in head.splitlines() if ln.strip()]
    if sep:
        last = [ln.strip() for ln in trace.splitlines() if ln.strip()]
        lines.append(last[-1] if last else "")
    text = " / ".join(ln for ln in lines if ln)
    if len(text) <= width:
        return text
    cut = text[:width - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut[width // 2:] else cut) + "..."


def counted(counts: dict) -> str:
    """``{"dead": 3, "identity": 1}`` as ``"dead 3, identity 1"``: counts by name, in text."""
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(counts.items()))
