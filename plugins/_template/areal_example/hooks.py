"""Hooks of this plugin (its entry point in the ``areal`` group names it).

areal imports this module on every ``areal`` call, so it imports nothing
heavy at module level: only :mod:`areal_core`; the CLI's Typer inside the hook.
"""

from __future__ import annotations

from areal_core import hookimpl


@hookimpl
def areal_register_commands(registrar) -> None:
    """Add ``areal <plugin name> score PROMPT COMPLETION ANSWER``, printing the reward."""
    import typer

    app = typer.Typer(no_args_is_help=True)

    @app.command()
    def score(
        prompt: str,
        completion: str,
        answer: str,
        case_sensitive: bool = typer.Option(False, "--case-sensitive", help="compare text case-sensitively"),
    ) -> None:
        """Print the exact-match reward of COMPLETION to PROMPT, whose right answer is ANSWER."""
        import asyncio

        from areal_core.api import Context, call_reward

        from areal_example.reward import ExactMatchConfig, ExactMatchReward

        reward = ExactMatchReward.create(Context(options=ExactMatchConfig(case_sensitive=case_sensitive)))
        result = asyncio.run(call_reward(reward, prompt, completion, {"answer": answer}))
        typer.echo(result.reward)

    @app.callback()
    def main() -> None:
        """Score completions with this plugin's exact-match reward."""

    registrar.add_group(app)  # named after this plugin's entry point: `areal example`
