"""Run inside the NeMo Gym venv: materialize rows exactly as `ng_collect_rollouts` would, offline.

usage: python preprocess.py INPUT OUTPUT NUM_REPEATS_JSON [AGENT_NAME]
Calls nemo_gym's own row preprocessing (no servers) with num_repeats_add_seed=true and writes the rows with
orjson, as the collector writes its *_materialized_inputs.jsonl.
"""

import json
import sys

import orjson
from nemo_gym.rollout_collection import RolloutCollectionConfig, RolloutCollectionHelper

inp, out, repeats = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kwargs = dict(input_jsonl_fpath=inp, output_jsonl_fpath=out, num_repeats=repeats, num_repeats_add_seed=True)
if len(sys.argv) > 4:
    kwargs["agent_name"] = sys.argv[4]
rows = RolloutCollectionHelper()._preprocess_rows_from_config(RolloutCollectionConfig(**kwargs))
with open(out, "wb") as f:
    for r in rows:
        f.write(orjson.dumps(r) + b"\n")
