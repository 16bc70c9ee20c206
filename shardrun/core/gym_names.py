"""NeMo Gym's names that every stage shares: the row keys that carry a rollout's identity and the files a Gym run
reads and writes (see NeMo Gym's `ng_collect_rollouts` and `ng_reward_profile`), and what a blend's label may be."""

import re

TASK_KEY = "_ng_task_index"
ROLLOUT_KEY = "_ng_rollout_index"
AGENT_KEY = "agent_ref"
RCP_KEY = "responses_create_params"

MATERIALIZED = "rollouts_materialized_inputs.jsonl"
ROLLOUTS = "rollouts.jsonl"
FAILURES = "rollouts_failures.jsonl"

# The ranges shardrun accepts for an identity, so that every planned rollout can be merged: the merge keys a rollout
# by task index x repeats + rollout index in a signed 64-bit integer.
MAX_TASK_INDEX = 2**40 - 1
MAX_REPEATS = 2**20
MAX_JSON_DEPTH = 253
"""Nesting (objects and arrays) a row may have: orjson writes at most 254 levels, and the reward profile nests each
task's row one level deeper (its `sample`)."""


LABEL_MAX = 100
LABEL_PATTERN = r"[A-Za-z0-9_-][A-Za-z0-9._-]*"
"""A label is a name, never a path: it names files and folders under merged/ (docs/blends.md)."""


def label_problem(label: str) -> str | None:
    """Why `label` is not a plain name (a path, `.`/`..`, a hidden name, a control character, too long); None when
    it is one."""
    if not label:
        return "an empty label"
    if len(label) > LABEL_MAX:
        return f"a label of {len(label)} characters (at most {LABEL_MAX})"
    if any(c in label for c in "/\\") or label in (".", ".."):
        return "a label is a name, never a path (no '/', '\\', '.' or '..')"
    if label.startswith("."):
        return "a label may not start with '.' (a hidden file name)"
    if not re.fullmatch(LABEL_PATTERN, label):
        return "a label is letters, digits, '.', '_' and '-' only (no spaces or control characters)"
    return None
