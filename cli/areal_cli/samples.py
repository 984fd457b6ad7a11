"""``areal samples RUN``: what the model wrote, from a run's ``completions.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from areal_core.completions import COMPLETIONS_FILE, read_records

console = Console(highlight=False, soft_wrap=True, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


def _fail(message: str) -> None:
    err.print(f"areal samples: {message}")
    raise typer.Exit(1)


def _source(run: Path) -> Path:
    path = run / COMPLETIONS_FILE if run.is_dir() else run
    if not path.is_file():
        _fail(f"{path} does not exist. Fix: give a run folder (<output_dir>/<experiment>/<trial>) of a run with "
              f"metrics.completions_every > 0, or its {COMPLETIONS_FILE}")
    return path


def _clip(text: str | None, chars: int, keep_end: bool = False) -> str:
    if text is None:
        return "(no text: the run's workflow has no tokenizer)"
    if chars <= 0 or len(text) <= chars:
        return text
    return "..." + text[-chars:] if keep_end else text[:chars] + f"... ({len(text) - chars} more characters)"


def _show(record: dict, chars: int, prompt_chars: int) -> None:
    info = record.get("reward_info") or {}
    how = info.get("method") or info.get("reason")
    versions = record.get("versions") or []
    head = (f"step {record['step']} · item {record.get('item')} · sample {record.get('sample')} · reward "
            f"{record.get('reward')}" + (f" ({how})" if how else "")
            + (f" · staleness {record.get('staleness')} (versions {versions[0]}-{versions[-1]})" if versions else "")
            + f" · {record.get('completion_tokens')} tokens")
    console.print(Text(head, style="bold"))
    console.print(Text("  prompt: ", style="dim") + Text(_clip(record.get("prompt"), prompt_chars, keep_end=True),
                                                         style="dim"))
    console.print(Text("  completion: ") + Text(_clip(record.get("completion"), chars)))
    console.print()


def samples(
    run: Annotated[Path, typer.Argument(help="a run folder, or its completions.jsonl", show_default=False)],
    step: Annotated[Optional[int], typer.Option("--step", help="the samples of this step [default: the latest "
                                                               "step written]")] = None,
    item: Annotated[Optional[int], typer.Option("--item", help="every sample of this data item, oldest first")] = None,
    worst: Annotated[bool, typer.Option("--worst", help="the lowest rewards of the whole run")] = False,
    count: Annotated[int, typer.Option("-n", "--count", min=1, help="how many samples")] = 4,
    chars: Annotated[int, typer.Option("--chars", min=0, help="characters of each completion (0 = all)")] = 600,
    prompt_chars: Annotated[int, typer.Option("--prompt-chars", min=0, help="the prompt's last characters "
                                                                           "(0 = all)")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="the records as JSON lines")] = False,
) -> None:
    """Show what the model wrote: the trained samples' prompts, completions, rewards and staleness, from a run's
    completions.jsonl (written every metrics.completions_every steps)."""
    if sum(x is not None and x is not False for x in (step, item, worst or None)) > 1:
        _fail("give one of --step, --item and --worst")
    records = read_records(_source(run))
    if not records:
        _fail(f"{_source(run)} holds no sample yet (the run writes them as its steps end)")
    if item is not None:
        chosen = [r for r in records if r.get("item") == item][:count]
        if not chosen:
            _fail(f"no sample of item {item} was written (items written: the first of each step's batch, up to "
                  f"metrics.completions_per_step)")
    elif worst:
        chosen = sorted(records, key=lambda r: (r.get("reward") is None, r.get("reward") or 0.0, -r["step"]))[:count]
    else:
        wanted = step if step is not None else max(r["step"] for r in records)
        chosen = [r for r in records if r["step"] == wanted][:count]
        if not chosen:
            steps = sorted({r["step"] for r in records})
            _fail(f"no sample of step {wanted} was written; steps written: {steps[0]}..{steps[-1]} "
                  f"({len(steps)} of them)")
    if as_json:
        for record in chosen:
            typer.echo(json.dumps(record, ensure_ascii=False))
        return
    for record in chosen:
        _show(record, chars, prompt_chars)
