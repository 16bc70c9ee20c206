"""NeMo Gym 0.7.x (Python >= 3.13.14 declared; runs on 3.13.0, installed with --ignore-requires-python).

- Commands: the `gym` command (`gym env start`, `gym eval run --no-serve`, `gym eval profile --inputs --rollouts`);
  the `ng_*` scripts still exist as deprecated aliases that print a notice and re-enter `gym`.
- Servers: besides resources_servers, responses_api_agents and responses_api_models, ng_run starts one
  `environment_servers/legacy_agent` per agent (`<agent>_environment_server`), which needs its own venv dir too.
- `+route_failures_to_sidecar=true`: a failed /run becomes a `rollouts_failures.jsonl` row
  (`_ng_failure_class` agent_run_error or agent_request_failed, with `_ng_failure_message` and the HTTP status)
  and collection goes on; resume gates an identity with a terminal row or NEMO_GYM_MAX_ROLLOUT_ATTEMPTS rows, so
  the release counts the attempts itself and nothing is read from the log.
- Resume (`+resume_from_cache=true`) on a pre-materialized file dispatches exactly the identities that are
  neither done nor gated, keeps the file unchanged, and repairs a torn last line of the rollouts and the sidecar
  itself. The output directory is created if missing.
- `mask_sample` marks a collected rollout whose reward is not a measurement (Python truthiness of the value: true,
  1, a non-empty string are masked; false, 0, null, a missing field are not). `gym eval profile` judges
  completeness on every row, then (`select_measured`) leaves masked rollouts and their materialized rows out of
  the quality statistics (per-task rows, agent metrics, repeat-level metrics), strips the flag from the rest,
  and adds `coverage/measured_rollouts`, `coverage/masked_rollouts`, `coverage/measured_tasks`,
  `coverage/fully_masked_tasks` to the agent metrics of each agent that had a masked rollout (an agent with
  nothing measured keeps a coverage-only entry). The aggregate metrics (`compute_aggregate_metrics`) make the
  same selection and add the same coverage.
- The profiler also writes `_repeat_level_metrics.json` (one row per agent and rollout index) and adds
  across-repeat statistics (`mean_across_repeats/...`) to `_agent_metrics.json`; a missing or failed rollout is
  left out of the profile (the collector's `count_missing_rollouts_as_zero` is off by default).
- A collection in which every dispatched rollout failed (all in the sidecar) and no earlier result exists raises
  "None of the N dispatched rollouts produced a result" and exits 1 (`rollout_collection._run_from_config`): for a
  shard round that is an ordinary end (a shard whose only open rollouts all failed at the judge), not a crash.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardrun.core.gym_release import GymAdapter


NO_RESULT = re.compile(r"RuntimeError: None of the \d+ dispatched rollouts produced a result")


class GymV07(GymAdapter):
    series = "0.7"
    python = "3.13"
    entry_point = "gym"
    server_kinds = ("resources_servers", "responses_api_agents", "responses_api_models", "environment_servers")
    repeat_level_metrics = True
    missing_policy = "omit"
    mask_field = "mask_sample"  # a truthy flag leaves the rollout out of the quality stats; never a stats column
    agent_name_overrides = True  # agent_name is agent_map._default: every row goes to it, with a new agent_ref

    def stack_command(self, venv: Path) -> list[str]:
        return [str(venv / "bin" / "gym"), "env", "start"]

    def collect_command(self, venv: Path) -> list[str]:
        return [str(venv / "bin" / "gym"), "eval", "run", "--no-serve"]

    def collect_flags(self) -> list[str]:
        return ["+route_failures_to_sidecar=true"]

    def reverify_command(self, venv: Path) -> list[str]:
        return [str(venv / "bin" / "gym"), "eval", "reverify"]

    def no_result_exit(self, log_text: str) -> bool:
        return NO_RESULT.search(log_text) is not None

    def profile_command(self, venv: Path, materialized: Path, rollouts: Path, partial: bool) -> list[str]:
        return [
            str(venv / "bin" / "gym"),
            "eval",
            "profile",
            "--inputs",
            str(materialized),
            "--rollouts",
            str(rollouts),
        ] + (["++allow_partial_rollouts=True"] if partial else [])
