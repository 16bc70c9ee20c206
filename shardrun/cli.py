"""The command line. Each command parses its arguments, calls one function, prints; it holds no logic.

Domain errors become one clear message and an exit code (2 for bad input or a plan mismatch); tracebacks only
with --debug.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from shardrun import config as config_mod
from shardrun.errors import ShardrunError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Plan, launch, resume and profile sharded NeMo Gym rollout collection.")
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    _state["debug"] = debug


def run(fn, *args, **kwargs):
    """Call a command's function, turning domain errors into a message and an exit code."""
    try:
        return fn(*args, **kwargs)
    except ShardrunError as e:
        if _state["debug"]:
            raise
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(e.exit_code) from None


@app.command()
def plan(
    config: Path = typer.Argument(..., help="Run config YAML."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Hydra overrides: key=value, +key=value, ++key=value."),
    write: bool = typer.Option(False, "--write", help="Materialize the run directory (plan.json and shard inputs)."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan summary as JSON."),
) -> None:
    """Validate the input and print the shard plan; with --write, materialize the run directory."""
    from shardrun import store, summary

    cfg = run(config_mod.load, config, overrides or [])
    the_plan = run(store.scan_input, cfg)
    written = None
    if write:
        the_plan, written = run(store.write_plan, cfg, the_plan)
    max_array = cfg.cluster_or_default.max_array_size or config_mod.DEFAULT_MAX_ARRAY_SIZE
    typer.echo(summary.plan_json(the_plan, max_array) if json_out else summary.plan_table(the_plan, max_array))
    for w in the_plan.warnings:
        typer.echo(f"warning: {w}", err=True)
    if write:
        state = "written" if written else "already planned (same fingerprint), nothing written"
        typer.echo(f"run directory: {cfg.run_dir} ({state})")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
