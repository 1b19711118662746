"""Every shell command in README.md and docs/*.md, checked against the code, so that a doc that
drifts fails CI.

A ```bash block runs: each ``kvferry ...`` and ``python script.py ...`` in it is run here (in a
scratch folder that links the repository's folders, so files it writes land there) and must exit
0. A block preceded by ``<!-- docs-test: parse-only (why) -->`` is expensive (minutes, a GPU, a
second machine): its ``kvferry`` commands are parsed by the CLI itself (every option must exist
and every value must have its type; shell globs must match files), the scripts it calls must
exist and take the options it gives them, and the test files it names must exist.
``<!-- docs-test: skip (why) -->`` leaves a block out (commands on files the reader writes).

Everywhere: ``uv run`` carries ``--locked``, and ``--no-dev`` unless it runs the test suite (a
bare ``uv run`` silently installs the 6 GB development group); ``uv sync --extra X`` and
``pip install '...[X]'`` name extras that exist. Besides the commands: the README's
Documentation list names every file in docs/, docs/two-machines.md's RuntimeConfig table every
field, and no doc names our own history ("stop 20", "issue 10", "seed 003").
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
import typer.main

from kvferry.cli import _register, app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Files another part of the project keeps: their blocks are parsed, never run (no markers there).
PARSE_ONLY_FILES = {"docs/fidelity.md", "docs/select.md"}
# Still naming our own history; their owner is to rewrite them, then they leave this set.
HISTORY_PENDING: set[str] = set()
KVFERRY = str(Path(sys.executable).with_name("kvferry"))
MARKER = re.compile(r"<!--\s*docs-test:\s*(parse-only|skip)\b")
WRAPPERS = {"time": 0, "nice": 2, "timeout": 1}  # tokens each takes after its name
SEPARATORS = {"&&", "||", ";", "|"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass
class Block:
    path: str
    line: int
    mode: str  # "run", "parse-only" or "skip"
    text: str


@dataclass
class Command:
    where: str
    program: str  # kvferry, python, pytest, bash, install
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    uv_flags: list[str] | None = None  # None: not run through uv


def _blocks() -> list[Block]:
    out = []
    for doc in DOCS:
        rel = doc.relative_to(ROOT).as_posix()
        lines = doc.read_text().split("\n")
        i = 0
        while i < len(lines):
            if lines[i].startswith("```bash"):
                j = i + 1
                while not lines[j].startswith("```"):
                    j += 1
                prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
                marked = MARKER.search(prev)
                mode = marked.group(1) if marked else "run"
                if rel in PARSE_ONLY_FILES and mode == "run":
                    mode = "parse-only"
                out.append(Block(rel, i + 1, mode, "\n".join(lines[i + 1 : j])))
                i = j
            i += 1
    return out


BLOCKS = _blocks()


def _commands(block: Block) -> list[Command]:
    """The commands of a block, as a reader would type them: continuations joined, heredoc bodies
    left out, a for loop's variable given its first value."""
    text = block.text.replace("\\\n", " ")
    out: list[Command] = []
    loop_vars: dict[str, str] = {}
    heredoc_end: str | None = None
    for n, raw in enumerate(text.split("\n")):
        if heredoc_end is not None:
            heredoc_end = None if raw.strip() == heredoc_end else heredoc_end
            continue
        if m := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", raw):
            heredoc_end = m.group(1)
        for var, value in loop_vars.items():
            raw = raw.replace(f"${{{var}}}", value).replace(f"${var}", value)
        tokens = shlex.split(raw, comments=True)
        segment: list[str] = []
        for tok in [*tokens, ";"]:
            if tok not in SEPARATORS:
                segment.append(tok)
                continue
            if segment[:1] == ["for"] and len(segment) >= 4 and segment[2] == "in":
                loop_vars[segment[1]] = segment[3]
            elif segment:
                cmd = _command(segment, f"{block.path}:{block.line + n + 1}")
                if cmd is not None:
                    out.append(cmd)
            segment = []
    return out


def _command(tokens: list[str], where: str) -> Command | None:
    env: dict[str, str] = {}
    t = list(tokens)
    while t and t[0] in ("do", "then", "else"):
        t.pop(0)
    while t and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", t[0]):
        k, _, v = t.pop(0).partition("=")
        env[k] = v
    while t and (t[0] in WRAPPERS or t[0] == "/usr/bin/time"):
        name = t.pop(0)
        skip = WRAPPERS.get(name, 0)
        while t and t[0].startswith("-"):  # /usr/bin/time -f FMT, nice -n N
            t.pop(0)
            skip = 1
        del t[:skip]
    t = _drop_redirections(t)
    uv_flags = None
    if t[:3] in (["python3", "-m", "uv"], ["python", "-m", "uv"]):
        t = t[2:]
    if t[:1] == ["uv"]:
        if t[1:2] == ["sync"]:
            return Command(where, "install", t, env)
        if t[1:2] != ["run"]:
            return None
        t, uv_flags = t[2:], []
        while t and t[0].startswith("-"):
            flag = t.pop(0)
            uv_flags.append(flag)
            if flag in ("--extra", "--group", "--with"):
                uv_flags.append(t.pop(0))
    if not t:
        return None
    prog = t[0].removeprefix(".venv/bin/")
    args = t[1:]
    if (prog in ("python", "python3") and args[:2] == ["-m", "pip"]) or prog == "pip":
        return Command(where, "install", t, env)
    if prog in ("python", "python3") and args[:2] == ["-m", "pytest"]:
        prog, args = "pytest", args[2:]
    if prog in ("python", "python3"):
        if not args or args[0] in ("-", "-c"):
            return None  # a heredoc or an inline program: shown, not a file of the repository
        return Command(where, "python", args, env, uv_flags)
    if prog in ("kvferry", "pytest", "bash"):
        return Command(where, prog, args, env, uv_flags)
    return None  # export, mkdir, cat, ...: shell around the commands


def _drop_redirections(tokens: list[str]) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
        elif tok in (">", ">>", "2>", "2>>", "<"):
            skip = True
        elif not re.fullmatch(r"\d?>>?\S+|2>&1", tok):
            out.append(tok)
    return out


ALL = [(b, c) for b in BLOCKS if b.mode != "skip" for c in _commands(b)]


def _id(bc: tuple[Block, Command]) -> str:
    return f"{bc[1].where} {bc[1].program} {' '.join(bc[1].args)[:40]}"


# ---- checks every command gets ------------------------------------------------------------------
@pytest.mark.parametrize("bc", ALL, ids=[_id(x) for x in ALL])
def test_command_matches_the_code(bc: tuple[Block, Command]) -> None:
    _, cmd = bc
    if cmd.uv_flags is not None:
        assert "--locked" in cmd.uv_flags, f"{cmd.where}: uv run without --locked"
        if cmd.program != "pytest":
            assert "--no-dev" in cmd.uv_flags, f"{cmd.where}: uv run without --no-dev installs the dev group"
        _check_extras(cmd.uv_flags, cmd.where)
    if cmd.program == "install":
        _check_extras(cmd.args, cmd.where)
    elif cmd.program == "kvferry":
        _parse_kvferry(cmd)
    elif cmd.program == "python":
        script = ROOT / cmd.args[0]
        assert script.is_file(), f"{cmd.where}: {cmd.args[0]} does not exist"
        source = script.read_text()
        for opt in (a.split("=")[0] for a in cmd.args[1:] if a.startswith("--")):
            assert f'"{opt}"' in source, f"{cmd.where}: {cmd.args[0]} takes no {opt}"
    elif cmd.program == "pytest":
        for a in cmd.args:
            if a.startswith("tests/"):
                assert (ROOT / a.split("::")[0]).is_file(), f"{cmd.where}: {a} does not exist"
    elif cmd.program == "bash":
        assert (ROOT / cmd.args[0]).is_file(), f"{cmd.where}: {cmd.args[0]} does not exist"


def _check_extras(args: list[str], where: str) -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--extra"]
    named += [x for a in args for m in re.finditer(r"\[([\w,-]+)\]", a) for x in m.group(1).split(",")]
    unknown = [x for x in named if x not in extras]
    assert not unknown, f"{where}: no extra {unknown} in pyproject.toml (known: {sorted(extras)})"


def _expand(args: list[str]) -> list[str]:
    """Shell globs as the shell expands them, from the repository root."""
    out = []
    for a in args:
        if any(c in a for c in "*?[") and not a.startswith("-"):
            hits = sorted(glob.glob(a, root_dir=ROOT))
            out += hits or [a]
        else:
            out.append(a)
    return out


@functools.cache
def _root() -> typer.core.TyperGroup:
    _register()
    return typer.main.get_command(app)  # type: ignore[return-value]


def _parse_kvferry(cmd: Command) -> None:
    """Parse the command line with the CLI's own parser (no command runs): unknown options,
    missing arguments and values of the wrong type fail."""
    group = _root()
    args = _expand(cmd.args)
    try:
        ctx = group.make_context("kvferry", list(args), resilient_parsing=False)
        sub_group, rest = group, _rest(ctx)
        while rest:
            sub = sub_group.get_command(ctx, rest[0])
            assert sub is not None, f"{cmd.where}: no command {rest[0]!r}"
            ctx = sub.make_context(rest[0], rest[1:], parent=ctx)
            if not hasattr(sub, "get_command"):
                break
            sub_group, rest = sub, _rest(ctx)
    except typer.Exit as e:  # the CLI's one-line usage error, already printed on stderr
        pytest.fail(f"{cmd.where}: kvferry {' '.join(cmd.args)}: does not parse (exit {e.exit_code})")


def _rest(ctx: object) -> list[str]:
    """What a group left for its subcommand (click 8.2 keeps the name apart, as _protected_args)."""
    protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])
    return [*protected, *ctx.args]  # type: ignore[attr-defined]


# ---- the cheap blocks run -----------------------------------------------------------------------
RUNS = [(b, c) for b, c in ALL if b.mode == "run" and c.program in ("kvferry", "python")]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that sees the repository's folders (scenarios/, examples/, ...) through links,
    so commands read the repository and write only here."""
    d = tmp_path_factory.mktemp("docs")
    for p in ROOT.iterdir():
        if not p.name.startswith("."):
            (d / p.name).symlink_to(p)
    return d


@pytest.mark.parametrize("bc", RUNS, ids=[_id(x) for x in RUNS])
def test_cheap_command_runs(bc: tuple[Block, Command], scratch: Path) -> None:
    _, cmd = bc
    argv = [KVFERRY, *cmd.args] if cmd.program == "kvferry" else [sys.executable, *cmd.args]
    env = dict(os.environ, **cmd.env)
    r = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=120)
    out = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, f"{cmd.where}: {' '.join(argv[1:])} exited {r.returncode}\n{out}"
    assert "Traceback" not in r.stderr, f"{cmd.where}: traceback\n{out}"


def test_the_cheap_commands_are_there() -> None:
    # The test would pass vacuously if the blocks were all marked: the README's own must run.
    ran = {c.where.split(":")[0] for _, c in RUNS}
    assert "README.md" in ran and len(RUNS) >= 6, [c.where for _, c in RUNS]


# ---- the rest of what a doc claims --------------------------------------------------------------
def test_readme_lists_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("## Documentation") :]
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"`docs/{p.name}`" not in listed]
    assert not missing, f"README's Documentation list lacks {missing}"


def test_two_machines_lists_every_runtime_config_field() -> None:
    from kvferry.backends.runtime import RuntimeConfig

    text = (ROOT / "docs" / "two-machines.md").read_text()
    missing = [f for f in RuntimeConfig.__struct_fields__ if f"| `{f}` |" not in text]
    assert not missing, f"docs/two-machines.md's RuntimeConfig table lacks {missing}"


HISTORY = re.compile(r"\b(stops? \d+|issues? \d+|issue-\d+|seeds? 0\d\d)\b", re.IGNORECASE)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.relative_to(ROOT).as_posix() not in HISTORY_PENDING])
def test_no_history_words(doc: Path) -> None:
    hits = [
        f"{doc.name}:{n}: {m.group(0)}"
        for n, line in enumerate(doc.read_text().split("\n"), 1)
        for m in HISTORY.finditer(line)
    ]
    assert not hits, "name upstream work by what it is, our own history not at all:\n" + "\n".join(hits)


def _python_block_after(text: str, title: str) -> str:
    start = text.index(f"{title}:\n\n```python\n") + len(f"{title}:\n\n```python\n")
    return text[start : text.index("\n```", start)]


def test_two_machine_scripts_run_on_loopback(tmp_path: Path) -> None:
    """docs/two-machines.md's prefill.py and decode.py, as printed, on 127.0.0.1 with a key file:
    the two-machine recipe minus the second machine."""
    import socket

    text = (ROOT / "docs" / "two-machines.md").read_text()
    for name in ("prefill.py", "decode.py"):
        (tmp_path / name).write_text(_python_block_after(text, f"`{name}`"))
    key = tmp_path / "kvferry.key"
    key.write_text("hex:" + os.urandom(32).hex() + "\n")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = dict(os.environ, KVFERRY_CONTROL_KEY_FILE=str(key), ROOMS="2", NIXL_LOG_LEVEL="WARN")
    env.pop("KVFERRY_CONTROL_KEY", None)
    prefill = subprocess.Popen(
        [sys.executable, "prefill.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(env, PREFILL_HOST="127.0.0.1", PREFILL_PORT=str(ports[0])),
    )  # fmt: skip
    decode = subprocess.run(
        [sys.executable, "decode.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=dict(env, DECODE_HOST="127.0.0.1", DECODE_PORT=str(ports[1]),
                 PREFILL_ADDRS=f"tcp://127.0.0.1:{ports[0]}"),
    )  # fmt: skip
    pre_out, _ = prefill.communicate(timeout=120)
    assert decode.returncode == 0 and prefill.returncode == 0, decode.stdout + decode.stderr + pre_out
    for room in (1000, 1001):
        assert f"room {room}: Success, 0 wrong bytes" in decode.stdout, decode.stdout + decode.stderr
        assert f"room {room}: Success" in pre_out, pre_out
