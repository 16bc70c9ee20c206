"""Run inside the NeMo Gym venv: Gym's own reward profile and pass@k for a materialized-inputs + rollouts pair.

usage: python profile_and_pass_at_k.py MATERIALIZED ROLLOUTS OUT_DIR
Writes OUT_DIR/rollouts_reward_profiling.jsonl and OUT_DIR/rollouts_agent_metrics.json (0.7: and the repeat-level
metrics) with Gym's RewardProfiler,
and OUT_DIR/pass_at_k.json: {agent: compute_pass_majority_metrics(...) metrics} with Gym's default score
(accuracy = reward), tasks grouped by task index and sorted by rollout index.
"""

import sys
from collections import defaultdict
from pathlib import Path

import orjson
from nemo_gym.reward_profile import RewardProfiler, compute_pass_majority_metrics

mat_path, roll_path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = [orjson.loads(line) for line in Path(mat_path).read_bytes().splitlines() if line.strip()]
results = [orjson.loads(line) for line in Path(roll_path).read_bytes().splitlines() if line.strip()]
rp = RewardProfiler()
profiled = rp.profile_from_data(rows, results)  # 0.4: (groups, agents); 0.7 adds the repeat-level rows
rp.write_to_disk(*profiled, out / "rollouts.jsonl")

by_agent = defaultdict(lambda: defaultdict(list))
agent_of = {r["_ng_task_index"]: r["agent_ref"]["name"] for r in rows}
for res in sorted(results, key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"])):
    by_agent[agent_of[res["_ng_task_index"]]][res["_ng_task_index"]].append(res)
metrics = {a: compute_pass_majority_metrics([tasks[t] for t in sorted(tasks)])[0] for a, tasks in by_agent.items()}
(out / "pass_at_k.json").write_bytes(orjson.dumps(metrics))
