"""`shardrun export RUN --to hf DIR`: a Hugging Face dataset folder that `datasets.load_dataset(DIR)` loads.

    DIR/README.md                                 the dataset card: YAML front matter (the `configs` that point
                                                  `datasets` at the Parquet file, tags, and a `shardrun` block with
                                                  the run's facts), then the same in words
    DIR/data/train-00000-of-00001.parquet         one row per exported task (export.task_records)

The folder is built beside DIR and renamed into place, so DIR is either the earlier export or the new one, never
half of either; an existing DIR is replaced only when it is empty or an earlier export (a card with a `shardrun`
block). `--push REPO` then uploads the folder to the Hub as a dataset repository with the token read from the
environment variable the user names (never from the command line, never shown): a missing variable is refused
before anything is written.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from shardrun.analysis import export, report
from shardrun.analysis.export import ExportData
from shardrun.core import credentials
from shardrun.core.errors import BadInput, ShardrunError
from shardrun.rundir import fileio, safepaths

DATA_FILE = "data/train-00000-of-00001.parquet"
CARD = "README.md"
CARD_KEY = "shardrun"  # the card's block of run facts (and the mark of an earlier export)
TMP_PREFIX = ".shardrun-export-"
REPO_ID = r"^[A-Za-z0-9][\w.-]*/[\w.-]+$"


@dataclass(frozen=True)
class HfResult:
    folder: Path
    tasks: int
    pushed: str | None = None  # the repository's URL when pushed


def token_of(token_env: str) -> str:
    """The Hub token from the environment variable named `token_env`; BadInput naming the variable (never a value)
    when it is not set or empty."""
    if not token_env or not token_env.replace("_", "").isalnum():
        raise BadInput(f"--token-env {token_env!r}: the NAME of an environment variable (e.g. HF_TOKEN)")
    token = os.environ.get(token_env, "")
    if not token.strip():
        raise BadInput(
            f"--push needs a Hugging Face token in the environment variable {token_env}, which is not set: "
            f"export {token_env}=<your token> (or name another variable with --token-env). Nothing was written"
        )
    return token


def is_earlier_export(folder: Path) -> bool:
    card = folder / CARD
    try:
        meta = front_matter(card.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get(CARD_KEY), dict)


def front_matter(text: str) -> Any:
    """The YAML front matter of a card (None when it has none)."""
    if not text.startswith("---\n"):
        return None
    end = text.find("\n---\n", 4)
    return yaml.safe_load(text[4:end]) if end >= 0 else None


def write(
    ex: ExportData,
    folder: Path,
    push: str | None = None,
    token_env: str = "HF_TOKEN",
    private: bool = False,
) -> HfResult:
    """Write the dataset folder (and push it when `push` names a repository). Every check (the libraries, the
    token's variable, the repository id, the folder) comes before the first byte is written."""
    pa = export.need("pyarrow", "hf")
    pq = export.need("pyarrow.parquet", "hf")
    token = None
    if push is not None:
        import re

        if not re.match(REPO_ID, push):
            raise BadInput(f"--push {push!r}: a Hub repository id, OWNER/NAME. Nothing was written")
        export.need("huggingface_hub", "hf")
        token = token_of(token_env)
    target = safepaths.output_folder(Path(folder), "--to hf DIR", ex.run_dir, is_earlier_export)
    records = export.task_records(ex)
    facts = export.run_facts(ex)
    target.parent.mkdir(parents=True, exist_ok=True)
    building = target.parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    try:
        (building / "data").mkdir(parents=True)
        table = pa.Table.from_pylist(records, schema=_schema(pa, records))
        data_path = building / DATA_FILE
        pq.write_table(table, data_path)
        with open(data_path, "rb") as f:
            os.fsync(f.fileno())
        fileio.atomic_write_bytes(building / CARD, card(facts, table.column_names).encode("utf-8"))
        report.shareable([building / CARD, data_path])  # a dataset is meant to be read by others
        _swap_in(building, target)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    pushed = _push(target, push, token, private) if push is not None and token is not None else None
    return HfResult(target, len(records), pushed)


def _schema(pa: Any, records: Sequence[dict[str, Any]]) -> Any:
    """The Parquet schema: integers, text, a nullable label and bucket, floats for every statistic, lists of floats
    for the rollouts (a missing number is null)."""
    kinds = {
        "task_index": pa.int64(),
        "agent": pa.string(),
        "label": pa.string(),
        "num_rollouts": pa.int64(),
        "expected_num_rollouts": pa.int64(),
        "stopped_early": pa.bool_(),
        "pass_rate": pa.float64(),
        "pass_rate_total": pa.int64(),
        "pass_rate_passed": pa.int64(),
        "bucket": pa.string(),
        "rollout_rewards": pa.list_(pa.float64()),
        "rollout_output_tokens": pa.list_(pa.float64()),
        "source_row": pa.string(),
    }
    names = list(records[0]) if records else list(kinds)
    return pa.schema([(n, kinds.get(n, pa.float64())) for n in names])


def _swap_in(building: Path, target: Path) -> None:
    """Rename the built folder into place; an earlier export there is moved aside first and removed after."""
    aside = target.parent / f"{TMP_PREFIX}{target.name}-old-{os.getpid()}"
    had = target.exists()
    if had:
        os.rename(target, aside)
    try:
        os.rename(building, target)
    except OSError:
        if had:
            os.rename(aside, target)
        raise
    fileio.fsync_dir(target.parent)
    if had:
        shutil.rmtree(aside, ignore_errors=True)


def _push(folder: Path, repo: str, token: str, private: bool) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo, repo_type="dataset", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="dataset", commit_message="shardrun export")
    except Exception as e:  # the Hub's errors (network, auth, ...) become one line without any token in it
        text = credentials.redact(str(e)).replace(token, "***")
        raise ShardrunError(
            f"--push {repo}: the upload failed ({type(e).__name__}: {text}); {folder} is written"
        ) from None
    return f"https://huggingface.co/datasets/{repo}"


# ---------------------------------------------------------------- the card (pure)


def card(facts: dict[str, Any], columns: Sequence[str]) -> str:
    """The dataset card: YAML front matter (`configs` for `datasets`, tags, the run's facts under `shardrun`), then
    a page in words: the run, the pass-rate histogram, the columns, how to load it."""
    meta = {
        "pretty_name": f"shardrun reward profile: {facts['run']}",
        "tags": ["shardrun", "nemo-gym", "reward-profile", "curriculum"],
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": DATA_FILE}]}],
        CARD_KEY: facts,
    }
    head = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=1000)
    model = facts["model"]
    rows = [
        ("checkpoint / model", model.get("model") or model.get("model_name") or "not recorded"),
        ("sampling", _sampling_text(facts["sampling"])),
        ("NeMo Gym", facts["gym_version"] or "not recorded"),
        ("plan fingerprint", f"`{facts['plan_fingerprint']}`"),
        ("tasks", _counts(facts["tasks"])),
        ("rollouts", _counts(facts["rollouts"])),
        ("failures", _failure_text(facts["failures"])),
    ]
    if facts["selection"] is not None:
        rows.append(("selection", _selection_text(facts["selection"])))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    histogram = _histogram_text(facts["pass_rate_histogram"])
    column_list = ", ".join(f"`{c}`" for c in columns)
    return (
        f"---\n{head}---\n\n"
        f"# {meta['pretty_name']}\n\n"
        "One row per task of a NeMo Gym rollout collection run by shardrun: the task's original input row "
        "(`source_row`, JSON text), its reward statistics over its rollouts, its pass rate and each rollout's "
        "reward and output length.\n\n"
        f"| | |\n|---|---|\n{table}\n\n"
        f"## Pass rate per task\n\n"
        f"Share of a task's completed rollouts whose reward reaches {facts['pass_rate_histogram']['solved_threshold']:g}"
        f":\n\n```text\n{histogram}\n```\n\n"
        f"## Columns\n\n{column_list}\n\n"
        "`<stat>/<field>` are the run's reward profile (NeMo Gym's `ng_reward_profile`): mean, std, min, max, median "
        "of the reward and of every numeric rollout field. `rollout_rewards` and `rollout_output_tokens` are in "
        "rollout-index order (null: the rollout recorded none). `label` is a blend's label (null otherwise); "
        "`bucket` is never / sometimes / always solved.\n\n"
        "## Loading\n\n```python\nimport json\nfrom datasets import load_dataset\n\n"
        'ds = load_dataset("path/to/this/folder", split="train")\nrow = json.loads(ds[0]["source_row"])\n```\n'
    )


def _sampling_text(s: dict[str, Any]) -> str:
    params = ", ".join(f"{k} {v}" for k, v in s["responses_create_params"].items()) or "the server's defaults"
    return f"{s['num_repeats']} rollouts per task (seed = {s['seed_offset']} + rollout index); {params}"


def _counts(c: dict[str, Any]) -> str:
    return ", ".join(f"{v:,} {k}" for k, v in c.items())


def _failure_text(f: dict[str, Any]) -> str:
    parts = []
    if "failed_rollouts" in f:
        rate = f["failure_rate"]
        by = ", ".join(f"{k} {v:,}" for k, v in f["by_class"].items())
        parts.append(f"{f['failed_rollouts']:,} failed" + (f" ({100 * rate:.2f}%)" if rate is not None else ""))
        if by:
            parts.append(f"by class: {by}")
    rate = f["without_result_rate"]
    parts.append(
        f"{f['rollouts_without_result']:,} planned rollouts without a result"
        + (f" ({100 * rate:.2f}%)" if rate is not None else "")
    )
    return "; ".join(parts)


def _selection_text(s: dict[str, Any]) -> str:
    return "; ".join(f"{step['rule']}: kept {step['kept']:,} of {step['before']:,}" for step in s["steps"])


def _histogram_text(h: dict[str, Any], width: int = 40) -> str:
    edges, counts = h["bin_edges"], h["counts"]
    top = max(counts) if counts and max(counts) else 1
    lines = []
    for i, n in enumerate(counts):
        close = "]" if i == len(counts) - 1 else ")"
        lines.append(f"[{edges[i]:.1f}, {edges[i + 1]:.1f}{close} {n:>7,} {'#' * round(width * n / top)}")
    return "\n".join(lines)
