"""Every command has help, with an example, and the CLI maps errors to exit codes."""

from __future__ import annotations

import click
import pytest

from bulkgen.cli import cli
from tests.helpers import invoke


def _all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, command in group.commands.items():
        out.append((*prefix, name))
        if isinstance(command, click.Group):
            out.extend(_all_commands(command, (*prefix, name)))
    return out


COMMANDS = _all_commands(cli)


def test_expected_commands_exist() -> None:
    names = {" ".join(c) for c in COMMANDS}
    assert {"submit", "list", "status", "cancel", "retry", "db", "db upgrade", "db current"} <= names


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_has_help_with_an_example(command: tuple[str, ...], flag: str) -> None:
    result = invoke(*command, flag)
    assert "Usage: " in result.output
    assert "Example:" in result.output
    assert "bulkgen " in result.output.split("Example:")[1]


def test_top_level_help_and_version() -> None:
    assert "Example:" in invoke("--help").output
    assert "version" in invoke("--version").output


def test_unknown_command_is_a_usage_error() -> None:
    assert invoke("frobnicate", expect=2).exit_code == 2


def test_missing_job_is_an_input_error(db_url: str) -> None:
    result = invoke("status", 42, expect=2)
    assert "no job 42" in result.output
