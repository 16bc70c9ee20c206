"""NeMo Gym's names that every stage shares: the row keys that carry a rollout's identity and the files a Gym run
reads and writes (see NeMo Gym's `ng_collect_rollouts` and `ng_reward_profile`)."""

TASK_KEY = "_ng_task_index"
ROLLOUT_KEY = "_ng_rollout_index"
AGENT_KEY = "agent_ref"
RCP_KEY = "responses_create_params"

MATERIALIZED = "rollouts_materialized_inputs.jsonl"
ROLLOUTS = "rollouts.jsonl"
FAILURES = "rollouts_failures.jsonl"
