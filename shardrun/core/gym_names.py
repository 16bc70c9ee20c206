"""NeMo Gym's names that every stage shares: the row keys that carry a rollout's identity and the files a Gym run
reads and writes (see NeMo Gym's `ng_collect_rollouts` and `ng_reward_profile`)."""

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
