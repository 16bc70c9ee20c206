"""The command line. Each command parses its arguments, calls one function, prints; it holds no logic.

Domain errors become one clear message and an exit code (2 for bad input or a plan mismatch); tracebacks only
with --debug.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

import typer
from typer.core import TyperGroup

from shardrun.core import config as config_mod
from shardrun.core import terminal
from shardrun.core.errors import ShardrunError


class _Commands(TyperGroup):
    """The command group: `--debug` is read wherever it stands before a `--` (`shardrun status RUN --debug` as well
    as `shardrun --debug status RUN`); it is moved before the command, where the group's option is parsed."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:end]:
            args = ["--debug"] + [a for i, a in enumerate(args) if not (a == "--debug" and i < end)]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    help="Plan, launch, resume and profile sharded NeMo Gym rollout collection.",
)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        from shardrun import __version__
        from shardrun.core import gym_version

        typer.echo(f"shardrun {__version__} (default NeMo Gym version {gym_version.DEFAULT_VERSION})")
        raise typer.Exit()


@app.callback()
def _main(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors (before or after the command)."),
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print shardrun's version and the default NeMo Gym version, and exit.",
    ),
) -> None:
    _state["debug"] = debug


def next_step(text: str, json_out: bool = False) -> None:
    """The line that says what comes after a stage (none after a JSON output: machines read it whole)."""
    if not json_out:
        say(f"next: {text}")


def shell_words(*words: object) -> str:
    """A command line the user can paste: each word quoted for the shell where it needs to be."""
    return " ".join(shlex.quote(str(w)) for w in words)


def say(text: str, err: bool = False) -> None:
    """Print human-readable text: every control character from data is shown escaped (core/terminal.py); JSON
    outputs are printed exact with typer.echo."""
    typer.echo(terminal.shown_lines(text), err=err)


def run(fn, *args, **kwargs):
    """Call a command's function, turning domain errors into a message and an exit code; a file-system error no
    stage turned into one (disk full, permission denied, a vanished path) is reported the same way (exit 2)."""
    try:
        return fn(*args, **kwargs)
    except (ShardrunError, OSError) as e:
        if _state["debug"]:
            raise
        if isinstance(e, OSError):
            from shardrun.rundir.store import os_error

            e = os_error(e)
        say(f"error: {e}", err=True)
        raise typer.Exit(e.exit_code) from None


@app.command()
def plan(
    config: Path = typer.Argument(..., help="Run config YAML."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Hydra overrides: key=value, +key=value, ++key=value."),
    write: bool = typer.Option(False, "--write", help="Materialize the run directory (plan.json and shard inputs)."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan summary as JSON."),
) -> None:
    """Validate the input and print the shard plan; with --write, materialize the run directory."""
    from shardrun.rundir import store
    from shardrun.plan import render

    from shardrun.launch import preflight

    cfg = run(config_mod.load, config, overrides or [])
    the_plan = run(store.scan_input, cfg)
    run(preflight.check_gpus, cfg)  # a self-hosted policy's GPUs fit the Slurm job (as submit checks)
    run(preflight.check_secrets, cfg)  # every variable gym.secrets names is set here (as submit checks)
    written = None
    if write:
        the_plan, written = run(store.write_plan, cfg, the_plan)
    max_array = cfg.cluster_or_default.max_array_size or config_mod.DEFAULT_MAX_ARRAY_SIZE
    if json_out:
        typer.echo(render.plan_json(the_plan, max_array))
    else:
        say(render.plan_table(the_plan, max_array))
    for w in the_plan.warnings:
        say(f"warning: {terminal.shown(w)}", err=True)
    if write:
        state = "written" if written else "already planned (same rollouts), nothing written"
        say(f"run directory: {terminal.shown(cfg.run_dir)} ({state})")
        next_step(terminal.shown(shell_words("shardrun", "submit", config, *(overrides or []))), json_out)


# select's rules (shardrun/analysis/selection.py), the same flags wherever a command chooses tasks (select, export)
_AGENT = typer.Option(None, "--agent", help="Keep tasks of this agent (repeatable).")
_LABEL = typer.Option(None, "--label", help="A blend: keep tasks of this label (repeatable; docs/blends.md).")
_MIN_MEAN = typer.Option(None, "--min-mean", help="Keep tasks with mean metric >= this.")
_MAX_MEAN = typer.Option(None, "--max-mean", help="Keep tasks with mean metric <= this.")
_MIN_STD = typer.Option(None, "--min-std", help="Keep tasks with std of the metric >= this.")
_MIN_MEAN_LENGTH = typer.Option(
    None,
    "--min-mean-length",
    help="Keep tasks whose mean output length (the profile's mean/output_tokens) >= this many tokens.",
)
_MAX_MEAN_LENGTH = typer.Option(
    None,
    "--max-mean-length",
    help="Keep tasks whose mean output length (mean/output_tokens) <= this many tokens; a task whose rollouts "
    "recorded no output tokens meets no length bound.",
)
_DROP_UNSOLVED = typer.Option(False, "--drop-unsolved", help="Drop tasks no rollout solved.")
_DROP_SOLVED = typer.Option(False, "--drop-solved", help="Drop tasks every rollout solved.")
_SOLVED_THRESHOLD = typer.Option(1.0, "--solved-threshold", help="A rollout solves a task at this metric.")
_TOP_K_HARDEST = typer.Option(None, "--top-k-hardest", help="Then keep the N lowest-mean tasks.")
_METRIC = typer.Option("reward", "--metric", help="Profile field the rules read (mean/<metric>, ...).")


def _rules(flags: dict[str, Any]) -> Any:
    """select's rules from a command's values of the rule flags above (select, export: each names them alike)."""
    from shardrun.analysis import selection

    return selection.Rules(
        metric=flags["metric"],
        agents=tuple(flags["agent"] or ()),
        labels=tuple(flags["label"] or ()),
        **{k: flags[k] for k in RULE_FLAGS},
    )


RULE_FLAGS = (
    "min_mean",
    "max_mean",
    "min_std",
    "min_mean_length",
    "max_mean_length",
    "drop_unsolved",
    "drop_solved",
    "solved_threshold",
    "top_k_hardest",
)


@app.command("select")
def select_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory with a merged reward profile."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the chosen input rows (JSONL)."),
    agent: Optional[list[str]] = _AGENT,
    label: Optional[list[str]] = _LABEL,
    min_mean: Optional[float] = _MIN_MEAN,
    max_mean: Optional[float] = _MAX_MEAN,
    min_std: Optional[float] = _MIN_STD,
    min_mean_length: Optional[float] = _MIN_MEAN_LENGTH,
    max_mean_length: Optional[float] = _MAX_MEAN_LENGTH,
    drop_unsolved: bool = _DROP_UNSOLVED,
    drop_solved: bool = _DROP_SOLVED,
    solved_threshold: float = _SOLVED_THRESHOLD,
    top_k_hardest: Optional[int] = _TOP_K_HARDEST,
    metric: str = _METRIC,
    attach_stats: bool = typer.Option(False, "--attach-stats", help="Add the task's stats to each row."),
    stats_key: Optional[str] = typer.Option(
        None, "--stats-key", help="Key for the stats (implies --attach-stats; default shardrun_stats)."
    ),
    input_path: Optional[Path] = typer.Option(None, "--input", help="The planned input file, if it moved."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    stats_format: str = typer.Option(
        "shardrun",
        "--stats-format",
        help="With --attach-stats: shardrun (an object under --stats-key) or nvidia (pass_rate, pass_rate_total, "
        "pass_rate_passed at the top level, as NVIDIA's RL training blends label prompts; passed = reward >= "
        "--solved-threshold). nvidia implies --attach-stats.",
    ),
    order: str = typer.Option(
        "input",
        "--order",
        help="input (the input's order) or difficulty (hardest first: lowest mean, then highest std).",
    ),
    undecided: Optional[str] = typer.Option(
        None,
        "--undecided",
        help="On an adaptive run: keep or drop the tasks stopped early that these rules are not decided on "
        "(default: refuse and name them).",
    ),
) -> None:
    """Write a curriculum subset of the original input rows, chosen by per-task reward statistics."""
    import orjson

    from shardrun.analysis import selection
    from shardrun.plan import render

    rules = _rules(locals())
    key = stats_key or ("shardrun_stats" if attach_stats else None)
    result = run(selection.select_run, run_dir, output, rules, key, input_path, stats_format, order, undecided)
    if json_out:
        typer.echo(orjson.dumps(selection.summary_json(result), option=orjson.OPT_INDENT_2).decode())
    else:
        say(render.table([(terminal.shown(k), terminal.shown(v)) for k, v in selection.summary_rows(result)]))


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="Run directory with a merged reward profile."),
    embed: bool = typer.Option(False, "--embed", help="Also inline the PNGs in the HTML (one file to share)."),
    sacct: bool = typer.Option(True, "--sacct/--no-sacct", help="On Slurm runs, add sacct GPU-hours."),
) -> None:
    """Write merged/report.html and its figures (PNG) for a merged run."""
    from shardrun.analysis import report as report_mod
    from shardrun.analysis import task_rewards
    from shardrun.plan import render

    result = run(report_mod.build_report, run_dir, embed, sacct)
    say(render.table([(terminal.shown(k), terminal.shown(v)) for k, v in report_mod.summary_rows(result)]))
    say("")
    say(run(task_rewards.load_short, run_dir))  # the per-task picture (`shardrun profile` has the task tables)


@app.command("profile")
def profile_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory with a merged reward profile."),
    top: int = typer.Option(
        10, "--top", min=0, help="How many of the hardest and of the easiest tasks to list (0: the summary only)."
    ),
    by: str = typer.Option("agent", "--by", help="Summarize per agent, or per label (a blend's; docs/blends.md)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary and the task lists as JSON."),
) -> None:
    """Print the per-task reward picture of a merged run: per agent (or label) the tasks, the mean of their mean
    rewards, its quartiles, the mean per-task std, how many tasks are never / sometimes / always solved; then the
    N hardest and N easiest tasks (mean, std, rollouts, the prompt's start)."""
    import orjson

    from shardrun.analysis import task_rewards

    picture = run(task_rewards.gather, run_dir, by, top)
    if json_out:
        typer.echo(orjson.dumps(task_rewards.to_json(picture, run_dir), option=orjson.OPT_INDENT_2).decode())
    else:
        say(task_rewards.render(picture))


@app.command()
def compare(
    base: Path = typer.Argument(..., help="The base run directory (merged)."),
    candidates: list[Path] = typer.Argument(..., help="One or more candidate run directories (merged)."),
    output: str = typer.Option(
        ..., "--output", "-o", help="Directory for compare_tasks.jsonl, compare.json, compare.html."
    ),
    key: Optional[str] = typer.Option(
        None,
        "--key",
        help="Pair tasks by this field of the input rows (default: by task index when the runs planned the same "
        "input, else by the sha256 of each row's responses_create_params).",
    ),
    solved_threshold: float = typer.Option(
        1.0, "--solved-threshold", help="A rollout solves its task at this reward (buckets never/sometimes/always)."
    ),
    resamples: int = typer.Option(2000, "--resamples", help="Bootstrap resamples for the 95% intervals."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap (the same seed gives the same intervals)."),
    embed: bool = typer.Option(False, "--embed", help="Also inline the PNGs in the HTML (one file to share)."),
    json_out: bool = typer.Option(False, "--json", help="Print compare.json instead of the table."),
) -> None:
    """Compare merged runs task by task: per-task deltas and buckets, mean, pass@1 and pass@k differences with
    bootstrap intervals, bucket flips and McNemar's test, per agent (and label); writes DIR and prints a table."""
    import orjson

    from shardrun.analysis import comparison

    result = run(comparison.build, base, candidates, output, key, solved_threshold, resamples, seed, embed)
    if json_out:
        typer.echo(orjson.dumps(result.comparison.summary, option=orjson.OPT_INDENT_2).decode())
    else:
        say(comparison.summary_text(result))  # agent names and labels are data: control characters shown escaped


@app.command()
def status(
    run_dir: Path = typer.Argument(..., help="Run directory."),
    json_out: bool = typer.Option(False, "--json", help="Print the status as JSON (every shard)."),
    watch: bool = typer.Option(False, "--watch", help="Redraw until every shard is sealed or nothing is live."),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between redraws with --watch."),
    show_all: bool = typer.Option(False, "--all", help="List every shard that is not sealed."),
) -> None:
    """Per shard: sealed, running, pending, failed (reason, log) or never started; rollouts, throughput, ETA."""
    from shardrun.launch import status as status_mod

    if watch:
        from shardrun.launch import progress

        run(progress.watch, run_dir, interval, say)
        return
    st = run(status_mod.collect, run_dir)
    if json_out:
        typer.echo(status_mod.render_json(st))
    else:
        say(status_mod.render(st, show_all=show_all))


@app.command()
def submit(
    config: Path = typer.Argument(..., help="Run config YAML (with gym and policy sections)."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Hydra overrides: key=value, +key=value, cluster=NAME."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Return after submitting (local executor waits by default)."),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Rehearse: run submit's checks and print the plan's warnings, then what would be submitted (Slurm: "
        "the array layout and the sbatch scripts); write and submit nothing. Exits as submit would where it refuses.",
    ),
    no_merge_job: bool = typer.Option(
        False, "--no-merge-job", help="Slurm: do not submit the merge-and-profile job that runs after the arrays."
    ),
) -> None:
    """Plan the run (refusing a different existing plan), launch every unsealed shard, print the run directory,
    the job ids and, when waiting, each shard's outcome."""
    from shardrun.launch import submission

    cfg = run(config_mod.load, config, overrides or [])
    result = run(
        submission.submit,
        cfg,
        wait_for_jobs=False if no_wait else None,
        echo=say,
        merge_job=not no_merge_job,
        dry_run=dry_run,
        warn=lambda w: say(f"warning: {terminal.shown(w)}", err=True),
    )
    if result.dry_run is not None:
        say(result.dry_run)
        return
    _said_submission(result)


def _said_submission(result) -> None:
    """What `submit` and `rescore` say of a launch, and the next step; a failed shard exits non-zero."""
    from shardrun.launch import submission

    if result.merge_job_id:
        say(f"merge job: {result.merge_job_id} (shardrun merge-and-profile, after the shard jobs end)")
    if result.live:
        say(f"still queued or running, not submitted again: {len(result.live)} shard(s)")
    for reason in result.ignored_markers:
        say(f"warning: {terminal.shown(reason)}", err=True)
    if result.already_sealed:
        say(f"already sealed: {len(result.already_sealed)} shard(s), not launched again")
    if not result.jobs and not result.workers and not result.live:
        say(f"run directory: {result.run_dir}\nevery shard is sealed; nothing to launch")
    for o in result.outcomes or []:
        say(f"shard {o.index:05d}: {o.state}" + (f" ({terminal.shown(o.detail)})" if o.detail else ""))
    run_dir = terminal.shown(shell_words(result.run_dir))
    if result.failed:
        found = submission.failures(result.run_dir, result)
        say(submission.failure_text(result.run_dir, result, found), err=True)
        next_step(f"shardrun status {run_dir}, then shardrun resume {run_dir}")
        raise typer.Exit(submission.failure_exit_code(found))
    if result.outcomes is not None and not result.live:
        next_step(f"shardrun merge-and-profile {run_dir}")
    elif result.merge_job_id:
        next_step(f"shardrun status {run_dir} (the merge job runs merge-and-profile when the shards end)")
    else:
        next_step(
            f"shardrun status {run_dir} --watch; when every shard is sealed: shardrun merge-and-profile {run_dir}"
        )


@app.command()
def rescore(
    run_dir: Path = typer.Argument(..., help="The run whose stored rollouts are re-scored (its shards sealed)."),
    overrides: Optional[list[str]] = typer.Argument(
        None, help="Hydra overrides of the source run's config, e.g. gym.overrides=[...] (the new scoring)."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="The new run directory."),
    failed_only: bool = typer.Option(
        False, "--failed-only", help="Re-verify only the rollouts whose scoring failed (Gym's --judge-failed-only)."
    ),
    force: bool = typer.Option(
        False, "--force", help="Re-verify also with resources servers that are not stateless (Gym's --force)."
    ),
    no_wait: bool = typer.Option(False, "--no-wait", help="Return after submitting (local executor waits by default)."),
) -> None:
    """Re-verify a run's stored rollouts with a changed Gym config, without the policy, into a new run directory
    (sharded and sealed like collection; run it again, or `shardrun resume NEW_RUN`, to finish an interrupted one);
    then `merge-and-profile` it and `compare` the two runs (docs/rescore.md)."""
    from shardrun.launch import submission
    from shardrun.rundir import rescore_source

    setup = run(rescore_source.rescore_config, run_dir, overrides or [], output, failed_only=failed_only, force=force)
    say(f"re-scoring {terminal.shown(str(setup.cfg.rescore.source_run))} (plan {setup.source_plan.fingerprint[:12]}…)")
    result = run(
        submission.submit,
        setup.cfg,
        wait_for_jobs=False if no_wait else None,
        echo=say,
        warn=lambda w: say(f"warning: {terminal.shown(w)}", err=True),
    )
    _said_submission(result)


@app.command()
def resume(
    run_dir: Path = typer.Argument(..., help="Run directory."),
    overrides: Optional[list[str]] = typer.Argument(
        None,
        help="Overrides applied to the saved launch settings (or to "
        "--config), e.g. cluster.max_attempts=5 cluster.partition=long.",
    ),
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        help="Resume with this run config instead of the settings the last launch saved (the plan must not change).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be resubmitted; submit nothing."),
    no_merge_job: bool = typer.Option(False, "--no-merge-job", help="Slurm: no merge-and-profile job afterwards."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Local executor: return after submitting."),
    allow_config_change: bool = typer.Option(
        False,
        "--allow-config-change",
        help="Accept a changed Gym or policy configuration (config files, overrides, server venvs, model); the "
        "change is recorded in the run's environment.json. Without it such a change is refused with the differences.",
    ),
    fill: bool = typer.Option(
        False,
        "--fill",
        help="Adaptive sampling: also collect the rollouts skipped because their task was decided (with a rule "
        "below: only for the tasks it keeps or leaves undecided); their shards are unsealed and run again.",
    ),
    fill_agent: Optional[list[str]] = typer.Option(None, "--agent", help="--fill: the tasks of this agent."),
    fill_min_mean: Optional[float] = typer.Option(None, "--min-mean", help="--fill: tasks with mean >= this."),
    fill_max_mean: Optional[float] = typer.Option(None, "--max-mean", help="--fill: tasks with mean <= this."),
    fill_drop_unsolved: bool = typer.Option(False, "--drop-unsolved", help="--fill: not the unsolved tasks."),
    fill_drop_solved: bool = typer.Option(False, "--drop-solved", help="--fill: not the tasks every rollout solved."),
    fill_threshold: float = typer.Option(1.0, "--solved-threshold", help="--fill: a rollout solves at this metric."),
    fill_metric: str = typer.Option("reward", "--metric", help="--fill: the field the rule reads."),
) -> None:
    """Resubmit the shards that are not sealed and not queued or running (each resumes from its last complete
    rollout); refuses if the input or config no longer give the run's plan, if the Gym venv holds another nemo-gym
    version than the plan's, or (unless --allow-config-change) if the Gym or policy configuration changed; gives up
    on a shard after cluster.max_attempts launches and says why."""
    from shardrun.launch import resume as resume_mod

    if fill:
        from shardrun.analysis import selection
        from shardrun.rundir import decided
        from shardrun.rundir import store as store_mod

        rules = selection.Rules(
            metric=fill_metric,
            agents=tuple(fill_agent or ()),
            min_mean=fill_min_mean,
            max_mean=fill_max_mean,
            drop_unsolved=fill_drop_unsolved,
            drop_solved=fill_drop_solved,
            solved_threshold=fill_threshold,
        )
        tasks = None if rules == selection.Rules() else run(selection.fill_tasks, run_dir, rules)
        reopened = run(decided.request_fill, run_dir, run(store_mod.load_plan, run_dir), tasks, dry_run)
        say(
            f"fill: {'every stopped task' if tasks is None else f'{len(tasks)} stopped task(s)'}; "
            f"{len(reopened)} shard(s) {'would be ' if dry_run else ''}unsealed to collect their skipped rollouts"
        )
    result = run(
        resume_mod.resume,
        run_dir,
        config,
        overrides or [],
        merge_job=not no_merge_job,
        dry_run=dry_run,
        wait_for_jobs=False if no_wait else None,
        echo=say,
        allow_config_change=allow_config_change,
    )
    say(resume_mod.render(result))
    if result.gave_up or result.failed:
        raise typer.Exit(4)


@app.command()
def cancel(run_dir: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Cancel the run's queued and running jobs (shards and merge job); their progress is kept for resume."""
    from shardrun.launch import resume as resume_mod

    say(resume_mod.render_cancel(run(resume_mod.cancel, run_dir)))


@app.command("run-shard")
def run_shard_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory (planned and launched once, so launch.json exists)."),
    index: int = typer.Argument(..., help="Shard index."),
) -> None:
    """Run one shard here, in this process (what a shard job does): servers, collection, seal, teardown."""
    from shardrun.shard import runtime

    result = run(runtime.run_shard, run_dir, index)
    say(f"shard {index:05d}: {result.state}")


@app.command("merge-and-profile")
def merge_and_profile_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory."),
    allow_partial: bool = typer.Option(
        False, "--allow-partial", help="Also merge what unsealed shards hold; report completion per task."
    ),
    answer_field: Optional[str] = typer.Option(
        None, "--answer-field", help="Rollout field with the extracted answer (enables majority@k)."
    ),
    workers: Optional[int] = typer.Option(
        None,
        "--workers",
        min=1,
        help="Processes that read the shards (default: the usable CPUs, at most 8; one for small runs).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the merge summary as JSON."),
    missing: Optional[str] = typer.Option(
        None,
        "--missing",
        help="What a planned rollout without a result (missing or failed) counts as in the aggregate metrics: omit "
        "(left out of the denominator) or zero (reward 0, no answer). Default: the run's Gym version's policy (omit).",
    ),
    raw_rewards_and_lengths: bool = typer.Option(
        False,
        "--raw-rewards-and-lengths",
        help="Each profile row also carries raw_rewards_and_lengths: per rollout, in rollout-index order, its "
        "_ng_rollout_index, reward and input/output/total tokens (NeMo Gym PR 2771's field; off: the profile is "
        "Gym's own, byte for byte).",
    ),
) -> None:
    """Merge sealed shards into merged/ (sorted rollouts and inputs, failures) and write Gym's reward profile,
    agent metrics and pass@k aggregate metrics (with each agent's coverage)."""
    import orjson

    from shardrun.merge import outcome
    from shardrun.profile import merge_and_profile

    result = run(
        merge_and_profile.merge_and_profile,
        run_dir,
        allow_partial,
        answer_field,
        workers,
        missing,
        raw_rewards_and_lengths=raw_rewards_and_lengths,
    )
    if json_out:
        typer.echo(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        say(outcome.render(result))
        say("")
        _short_picture(run_dir)
    next_step(terminal.shown(shell_words("shardrun", "report", run_dir)), json_out)


@app.command("export")
def export_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory with a merged reward profile."),
    dest: Optional[str] = typer.Argument(
        None,
        metavar="[DEST]",
        help="hf: the dataset folder to write (required). mlflow: the tracking URI (default: a file store in "
        "RUN_DIR/mlruns). wandb: the folder the run folder goes under (default: RUN_DIR).",
    ),
    to: str = typer.Option(..., "--to", help="hf (a Hugging Face dataset folder), mlflow or wandb."),
    push: Optional[str] = typer.Option(
        None, "--push", help="hf: then upload the folder to this Hub dataset repository (OWNER/NAME)."
    ),
    token_env: str = typer.Option(
        "HF_TOKEN", "--token-env", help="hf --push: the NAME of the environment variable holding the Hub token."
    ),
    private: bool = typer.Option(False, "--private", help="hf --push: create the repository private."),
    project: str = typer.Option(
        "shardrun", "--project", help="mlflow: the experiment; wandb: the project (default shardrun)."
    ),
    entity: Optional[str] = typer.Option(None, "--entity", help="wandb: the team or user the run belongs to."),
    run_name: Optional[str] = typer.Option(
        None, "--run-name", help="mlflow, wandb: the run's name (default: RUN_DIR's)."
    ),
    online: bool = typer.Option(
        False,
        "--online",
        help="wandb: upload now (needs a W&B login); default offline, synced later with `wandb sync`.",
    ),
    agent: Optional[list[str]] = _AGENT,
    label: Optional[list[str]] = _LABEL,
    min_mean: Optional[float] = _MIN_MEAN,
    max_mean: Optional[float] = _MAX_MEAN,
    min_std: Optional[float] = _MIN_STD,
    min_mean_length: Optional[float] = _MIN_MEAN_LENGTH,
    max_mean_length: Optional[float] = _MAX_MEAN_LENGTH,
    drop_unsolved: bool = _DROP_UNSOLVED,
    drop_solved: bool = _DROP_SOLVED,
    solved_threshold: float = _SOLVED_THRESHOLD,
    top_k_hardest: Optional[int] = _TOP_K_HARDEST,
    metric: str = _METRIC,
    undecided: Optional[str] = typer.Option(
        None, "--undecided", help="As select's: keep or drop the stopped tasks these rules are not decided on."
    ),
    input_path: Optional[Path] = typer.Option(None, "--input", help="The planned input file, if it moved."),
) -> None:
    """Export a merged run: a Hugging Face dataset folder (--to hf DIR, one row per task with its source row; --push
    REPO uploads it), an MLflow run (--to mlflow [URI]) or a W&B run (--to wandb [DIR], offline by default). select's
    rules choose the tasks (all without one)."""
    from shardrun.analysis import export

    if to not in export.TARGETS:
        say(f"error: --to {terminal.shown(to)}: one of {', '.join(export.TARGETS)}", err=True)
        raise typer.Exit(2)
    if to == "hf" and dest is None:
        say("error: --to hf needs DEST, the dataset folder to write", err=True)
        raise typer.Exit(2)
    if push is not None and to != "hf":
        say("error: --push uploads a Hugging Face dataset: it goes with --to hf", err=True)
        raise typer.Exit(2)
    rules = _rules(locals())
    if to == "hf":
        from shardrun.analysis import hf_dataset

        for module in ("pyarrow", *(["huggingface_hub"] if push is not None else [])):
            run(export.need, module, to)
        if push is not None:
            run(hf_dataset.token_of, token_env)  # refused before the run is read or anything written
    else:
        run(export.need, to, to)
    data = run(export.gather, run_dir, rules, undecided, input_path)
    for s in data.steps:
        say(f"{terminal.shown(s.rule)}: kept {s.kept:,} of {s.before:,}")
    if to == "hf":
        assert dest is not None
        got = run(hf_dataset.write, data, Path(dest), push, token_env, private)
        say(f"dataset: {got.tasks:,} tasks -> {terminal.shown(str(got.folder))}")
        if got.pushed:
            say(f"pushed: {got.pushed}")
        load = f"import datasets; print(datasets.load_dataset({str(got.folder)!r}))"
        next_step(terminal.shown(shell_words("python", "-c", load)))
        return
    from shardrun.analysis import tracking

    if to == "mlflow":
        tracked = run(tracking.to_mlflow, data, dest, project, run_name)
    else:
        tracked = run(tracking.to_wandb, data, Path(dest) if dest else None, project, entity, run_name, online)
    for note in tracked.notes:
        say(f"note: {terminal.shown(note)}", err=True)
    say(
        f"{to} run {tracked.run_id}: {tracked.params:,} parameters, {tracked.metrics:,} metrics, "
        f"{len(tracked.artifacts):,} artifacts -> {terminal.shown(tracked.where)}"
    )
    if to == "mlflow":
        next_step(terminal.shown(shell_words("mlflow", "ui", "--backend-store-uri", tracked.where)))
    elif not online:
        next_step(terminal.shown(shell_words("wandb", "sync", tracked.where)))


def _short_picture(run_dir: Path) -> None:
    """The per-task picture after a merge, read back from the profile it wrote; the merge stands if it cannot be
    read (a warning says why)."""
    from shardrun.analysis import task_rewards

    try:
        say(task_rewards.load_short(run_dir))
    except (ShardrunError, OSError) as e:
        if _state["debug"]:
            raise
        say(f"warning: the per-task picture could not be read back: {terminal.shown(e)}", err=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
