"""NeMo Gym 0.4.x: the release shardrun was first built on (Python 3.12).

- Commands: `ng_run`, `ng_collect_rollouts`, `ng_reward_profile` (`+materialized_inputs_jsonl_fpath`,
  `+rollouts_jsonl_fpath`, `++allow_partial_rollouts=True`).
- Servers: resources_servers, responses_api_agents, responses_api_models.
- A /run that fails aborts the whole collector (exit 1) and nothing reaches the failures sidecar. With the stack's
  request debugging on (`+global_aiohttp_client_request_debug=true`) the collector first prints
  `[rollout_collection] /run failed status=<code> row={"_ng_rollout_index": r, "_ng_task_index": t, ...}`, after
  the response body it got: `failed_identities` reads those lines, and shardrun's retry ledger counts the attempts.
  Request debugging also prints a failed request's headers (the policy key among them); the processes seam
  masks the key in ng_run's log.
- Resume (`+resume_from_cache=true`) gates an identity with a terminal sidecar row or at least
  NEMO_GYM_MAX_ROLLOUT_ATTEMPTS sidecar rows.
- The profiler writes `_reward_profiling.jsonl` and `_agent_metrics.json`; a missing or failed rollout is left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from shardrun.core.gym_errors import reason_text
from shardrun.core.gym_release import GymAdapter, Key

FAILED_RUN = re.compile(r"\[rollout_collection\] /run failed status=(\S+) row=(\{[^\n]*\})")
RESPONSE_CONTENT = re.compile(r"Response content: (b?['\"].*)")


class GymV04(GymAdapter):
    series = "0.4"
    python = "3.12"
    entry_point = "ng_run"
    server_kinds = ("resources_servers", "responses_api_agents", "responses_api_models")
    repeat_level_metrics = False
    missing_policy = "omit"
    mask_field = None  # `mask_sample` is an ordinary field: profiled like any other number
    agent_name_overrides = False  # +agent_name fills in rows without an agent_ref

    def stack_command(self, venv: Path) -> list[str]:
        return [str(venv / "bin" / "ng_run")]

    def stack_flags(self) -> list[str]:
        return ["+global_aiohttp_client_request_debug=true"]

    def collect_command(self, venv: Path) -> list[str]:
        return [str(venv / "bin" / "ng_collect_rollouts")]

    def profile_command(self, venv: Path, materialized: Path, rollouts: Path, partial: bool) -> list[str]:
        return [
            str(venv / "bin" / "ng_reward_profile"),
            f"+materialized_inputs_jsonl_fpath={materialized}",
            f"+rollouts_jsonl_fpath={rollouts}",
        ] + (["++allow_partial_rollouts=True"] if partial else [])

    def failed_identities(self, log_text: str) -> dict[Key, str]:
        out = {}
        last_content = ""
        for line in log_text.splitlines():
            m = RESPONSE_CONTENT.search(line)
            if m:
                last_content = m.group(1)
                continue
            m = FAILED_RUN.search(line)
            if not m:
                continue
            try:
                row = json.loads(m.group(2))
                key = (int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
            except (ValueError, KeyError, TypeError):
                continue
            out[key] = reason_text(m.group(1), last_content)
            last_content = ""
        return out
