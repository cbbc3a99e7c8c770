"""Every command has help, with an example, and the CLI maps errors to exit codes."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from bulkgen.cli import cli
from tests.helpers import invoke


def _all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # the root group loads each command's module as it is asked for
        command = group.get_command(ctx, name)
        out.append((*prefix, name))
        if isinstance(command, click.Group):
            out.extend(_all_commands(command, (*prefix, name)))
    return out


COMMANDS = _all_commands(cli)


def test_expected_commands_exist() -> None:
    names = {" ".join(c) for c in COMMANDS}
    assert {"submit", "list", "status", "cancel", "retry", "run", "export", "db", "db upgrade", "db current",
            "bench", "bench compare", "bench suite", "bench queue", "bench make-workload"} <= names


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


@pytest.mark.parametrize("command", ["status", "export", "cancel", "retry", "run"])
def test_a_negative_job_id_is_a_bad_job_id(command: str, db_url: str) -> None:
    result = invoke(command, "-1", expect=2)
    assert "a job id is a positive integer (see `bulkgen list`), got '-1'" in result.output
    assert "No such option" in invoke("status", "1", "--jsn", expect=2).output, "a mistyped option stays one"


def _not_a_database(tmp_path: Path) -> str:
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n")
    return f"sqlite:///{path}"


BAD_DATABASES = [
    ("a directory", lambda d: f"sqlite:///{d}", "is a directory: give a file, such as"),
    ("not a database", _not_a_database, "file is not a database; give --db (or BULKGEN_DB) a bulkgen database"),
    ("an unwritable place", lambda d: "sqlite:////proc/bulkgen.db", "unable to open database file"),
    ("a malformed URL", lambda d: "garbage://::x", "cannot read database URL 'garbage://::x'"),
    ("a missing directory", lambda d: f"sqlite:///{d}/no/such/dir/x.db", "/no/such/dir of database"),
]


@pytest.mark.parametrize("case", BAD_DATABASES, ids=[c[0] for c in BAD_DATABASES])
def test_a_bad_database_is_one_line_and_exit_2(case, tmp_path: Path) -> None:
    _name, make_url, message = case
    for command in (("list",), ("status", "1"), ("db", "current")):
        result = invoke(*command, "--db", make_url(tmp_path), expect=2)
        assert message in result.output and result.output.startswith("error: ") and result.output.count("\n") == 1
    assert not (tmp_path / "no").exists(), "a mistyped path makes no new queue"


def test_an_unreachable_or_missing_postgresql_database_is_one_line_naming_the_host() -> None:
    for url, words in [("postgresql+psycopg://postgres@127.0.0.1:1/test", "127.0.0.1"),
                       ("postgresql+psycopg://postgres@127.0.0.1:5432/no_such_bulkgen_db", "createdb")]:
        result = invoke("list", "--db", url, expect=2)
        assert words in result.output and "Traceback" not in result.output and len(result.output.splitlines()) == 1


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_ctrl_c_during_submit_stops_with_nothing_written(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    """SIGINT while submit writes a big file: one line, exit 130 (the shell's for Ctrl-C), no job, no request."""
    import signal
    import subprocess
    import time

    from bulkgen.store.models import Job, Request
    from tests.helpers import count_rows, write_parquet
    from tests.zygote import bulkgen_process

    data = write_parquet(tmp_path / "big.parquet", {"prompt": [f"row {i} of a long file" for i in range(100_000)]})
    proc = bulkgen_process(["submit", data, "--model", tiny_model_dir, "--db", db_url], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while count_rows(db_url, Request) == 0:  # submit is writing rows now
        assert proc.poll() is None and time.monotonic() < deadline, "submit ended before it wrote a row"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "stopped: nothing was written (the job was not made)"
    assert "Aborted" not in err and "Traceback" not in err
    assert count_rows(db_url, Job) == 0 and count_rows(db_url, Request) == 0
