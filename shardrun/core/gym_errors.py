"""What went wrong in a failed NeMo Gym /run, in a few words, from the nested error body Gym passes up.

Each Gym server that calls another wraps the inner server's error body in its own ("Hit an exception in <server>
calling an inner server: b'...'"), escaping it once more. `reason_text` reads the innermost error message and the
server that met it: "/run failed with HTTP 500 (VLLMModel___policy_model: injected 400)". Gym 0.4 prints the body
in the collector's log; Gym 0.7 keeps it in the failures sidecar row (`_ng_failure_response_body`, with
`_ng_failure_http_status`).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

MESSAGE = re.compile(r"[\"']message[\"']\s*:\s*[\"']([^\"']{1,200})")
WHERE = re.compile(r"Hit an exception in (\S+?) calling")
EXCEPTION = re.compile(r"\b([A-Za-z_]\w*(?:Error|Exception))\(['\"]([^'\"]{1,200})")  # e.g. a body that is no JSON
REASON_WHERE = re.compile(r"^/run failed with HTTP \S+ \((\w+___[^\s:)]+)(?:: |\)$)")  # reason_text's own shape
SIDECAR_STATUS = "_ng_failure_http_status"  # Gym 0.7's failure row fields
SIDECAR_BODY = "_ng_failure_response_body"
SIDECAR_MESSAGE = "_ng_failure_message"
SIDECAR_JUDGE_ERROR = "_ng_failure_judge_error"  # Gym 0.7's judge_failsafe: the judge call's error


def reason_text(status: str, content: str) -> str:
    """A short reason: the agent's HTTP status and the innermost error message of the (nested) response body."""
    flat = re.sub(r"\\+", "", content)
    messages = MESSAGE.findall(flat) or [f"{name}: {text}" for name, text in EXCEPTION.findall(flat)]
    where = WHERE.findall(flat)
    detail = ": ".join(x for x in (where[-1] if where else "", messages[-1].strip() if messages else "") if x)
    return f"/run failed with HTTP {status}" + (f" ({detail})" if detail else "")


def innermost_server(text: str) -> str | None:
    """The innermost Gym server ("<Class>___<name>") a nested error body names, or the server a reason written by
    `reason_text` names; None when there is none."""
    where = WHERE.findall(re.sub(r"\\+", "", text))
    if where:
        return str(where[-1])
    found = REASON_WHERE.match(text)
    return found.group(1) if found else None


def sidecar_reason(row: Mapping[str, Any]) -> str | None:
    """The reason of a Gym 0.7 failure row (None for rows without its fields)."""
    status, body = row.get(SIDECAR_STATUS), row.get(SIDECAR_BODY)
    judge_error = row.get(SIDECAR_JUDGE_ERROR)
    if judge_error:
        return f"judge call failed ({str(judge_error)[:200]})"
    if status is None and body is None:
        message = row.get(SIDECAR_MESSAGE)
        return str(message) if message else None
    return reason_text(str(status), str(body or ""))
