"""What looks like a credential: by the name it is stored under, and by its value (pure).

shardrun never stores or renders a secret: the config names the environment variable that holds it. A value is
taken for a credential when it has the shape of a well-known token (OpenAI, Hugging Face, GitHub, AWS, Slack,
a private key block), or when it is a long, high-entropy string under a key-like name (`*_KEY`, `*TOKEN`,
`PASSWORD`, ...). Paths and URLs are never taken for credentials by entropy alone (a token inside a URL still is,
by its shape). The finder reports where a credential is, never the value itself.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Iterator

SECRET_NAME = re.compile(r"(api_?key|key|token|password|passwd|secret|credentials?)$", re.IGNORECASE)
"""A key or variable name under which a value is a secret (API_KEY, HF_TOKEN, policy_api_key, db_password)."""

TOKEN_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an OpenAI API key", re.compile(r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}")),
    ("an Anthropic API key", re.compile(r"\bsk-ant-[A-Za-z0-9_-]{20,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})")),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
)
URL_PASSWORD = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^/?#@\s:]*):([^/?#@\s]+)@")
"""A URL with a `user:password@` part: the password is group 3 (`https://bob:hunter2@host/v1`)."""
_SHELL_REFERENCE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MIN_SECRET_LENGTH = 16
MIN_SECRET_ENTROPY = 3.0  # bits per character; English words and identifiers stay below, random keys above
_PATH_OR_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*://|/|\./|\.\./|~)")


def entropy(text: str) -> float:
    """Shannon entropy of the characters of `text`, in bits per character."""
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values()) if text else 0.0


def token_shape(value: str) -> str | None:
    """The kind of well-known token `value` holds anywhere in it, or None."""
    for kind, pattern in TOKEN_SHAPES:
        if pattern.search(value):
            return kind
    return None


def url_password(value: str) -> bool:
    """Whether `value` holds a URL with a password in it (`scheme://user:password@host`); a shell variable
    reference in its place (`https://bob:$TOKEN@host`, expanded where it runs) is not one."""
    return any(not _SHELL_REFERENCE.fullmatch(m.group(3)) for m in URL_PASSWORD.finditer(value))


def secret_reason(name: str, value: str) -> str | None:
    """Why `value`, stored under `name`, is a credential; None when it is not one."""
    kind = token_shape(value)
    if kind:
        return f"holds what looks like {kind}"
    if url_password(value):
        return (
            "holds a URL with a password (user:password@host); leave the password out of the URL and put it in an "
            "environment variable the config names (like policy.api_key_env)"
        )
    stem = name[: -len("_env")] if name.lower().endswith("_env") else None
    if stem and SECRET_NAME.search(stem) and value and not _VARIABLE_NAME.fullmatch(value):
        return f"{name!r} takes the NAME of an environment variable, and this value is not one (the secret itself?)"
    if (
        SECRET_NAME.search(name)
        and len(value) >= MIN_SECRET_LENGTH
        and not _PATH_OR_URL.match(value)
        and not any(c.isspace() for c in value)
        and entropy(value) >= MIN_SECRET_ENTROPY
    ):
        return f"{name!r} names a secret and its value looks like one (long and random)"
    return None


NAME_MAPS = ("gym.secrets",)
"""Sections whose values are NAMEs of environment variables under whatever keys (`gym.secrets`: the variable Gym's
configs reference -> the environment variable holding it): judged by name_reason, not by their keys."""


def name_reason(value: str) -> str | None:
    """Why `value`, where the NAME of an environment variable belongs, is not one (the secret itself?); None for a
    name. A name is letters, digits and `_`, not starting with a digit, and not shaped like a token: a long random
    word with digits (mixed case, or no `_` at all) is taken for a key pasted in its place."""
    kind = token_shape(value)
    if kind:
        return f"holds what looks like {kind}, where the NAME of an environment variable belongs"
    if not _VARIABLE_NAME.fullmatch(value):
        return (
            "takes the NAME of an environment variable (letters, digits, _), and this value is not one "
            "(the secret itself?)"
        )
    if (
        len(value) >= MIN_SECRET_LENGTH
        and entropy(value) >= MIN_SECRET_ENTROPY
        and any(c.isdigit() for c in value)
        and ("_" not in value or (value.upper() != value and value.lower() != value))
    ):
        return "looks like a secret (long and random), not the NAME of an environment variable"
    return None


def find_credentials(data: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(dotted location, reason) for every credential in a nested dict/list of strings; `NAME=value` strings
    (overrides, env_vars) are judged as value `value` under name `NAME`. The values of a NAME_MAPS section (and an
    override of one of its keys) are judged as names of environment variables (name_reason)."""
    if isinstance(data, dict):
        for key, value in data.items():
            here = f"{where}.{key}" if where else str(key)
            if where in NAME_MAPS and isinstance(value, str):
                reason = name_reason(value)
                if reason:
                    yield here, reason
                continue
            yield from find_credentials(value, here)
        return
    if isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            yield from find_credentials(value, f"{where}[{i}]")
        return
    if not isinstance(data, str):
        return
    name = where.rsplit(".", 1)[-1].split("[", 1)[0]
    key, sep, value = data.partition("=")
    if sep and re.fullmatch(r"[+~]{0,2}[A-Za-z_][\w.]*", key):
        section = key.lstrip("+~").rsplit(".", 1)[0]
        if section in NAME_MAPS:
            reason = name_reason(value)
            if reason:
                yield where or "(value)", reason
            return
        name, data = key.lstrip("+~").rsplit(".", 1)[-1], value
    reason = secret_reason(name, data)
    if reason:
        yield where or "(value)", reason


def redact(text: str) -> str:
    """`text` (an error message that may quote a config line or an override) with every well-known token and
    every password in a URL replaced by `***`."""
    for _kind, pattern in TOKEN_SHAPES:
        text = pattern.sub("***", text)
    return URL_PASSWORD.sub(
        lambda m: m.group(0) if _SHELL_REFERENCE.fullmatch(m.group(3)) else f"{m.group(1)}{m.group(2)}:***@", text
    )
