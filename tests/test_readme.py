"""Every command the README and the documents in docs/ show works as written in a fresh
clone: each `.venv/bin/hydra-jury ...` parses with the real argument parsers, each `make
TARGET` names a target of the Makefile, and every relative link leads to a file."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hydra_jury.cli import build_parser
from hydra_jury.jury_service.server import JURY_SERVICE
from hydra_jury.orchestrator.__main__ import build_parser as orchestrator_parser
from hydra_jury.serving.worker_service import build_parser as service_parser
from hydra_jury.trunk_service.server import TRUNK_SERVICE

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEXTS = {path: path.read_text() for path in DOCUMENTS}
CLI = ".venv/bin/hydra-jury"


def shell_lines() -> list[str]:
    """Lines of the ```sh blocks, continuations joined, and inline `...` commands."""
    lines = []
    for text in TEXTS.values():
        for block in re.findall(r"```sh\n(.*?)```", text, re.S):
            lines += [line.strip() for line in block.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`(\.venv/bin/hydra-jury [^`]+)`", text)
    return [line for line in lines if line and not line.startswith("#")]


def as_arguments(command: str) -> list[str]:
    """A usage line as arguments: optional groups opened, the first of alternatives."""
    command = re.sub(r"(\w+)(\|\w+)+", r"\1", command)
    command = command.replace("[", " ").replace("]", " ").replace("...", " ")
    command = command.split("#")[0]
    # the usage line's number placeholders
    numbers = {"K": "26", "N": "4", "RANK": "8", "RATE": "0.001"}
    return [numbers.get(word, word) for word in shlex.split(command)[1:]]


COMMANDS = [line for line in shell_lines() if line.startswith(CLI)]
MAKE_TARGETS = sorted({m for line in shell_lines() for m in re.findall(r"^make ([\w-]+)", line)})


def test_the_readme_shows_commands():
    assert len(COMMANDS) >= 8 and {"test", "run"} <= set(MAKE_TARGETS)
    bare = [line for line in shell_lines() if line.startswith("hydra-jury ")]
    assert not bare, f"commands that need an activated virtualenv: {bare}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_parses(command):
    arguments = as_arguments(command)
    name, rest = arguments[0], arguments[1:]
    parsers = {
        "trunk": lambda: service_parser(TRUNK_SERVICE, "hydra-jury trunk"),
        "jury": lambda: service_parser(JURY_SERVICE, "hydra-jury jury"),
        "orchestrator": lambda: orchestrator_parser("hydra-jury orchestrator"),
    }
    try:
        if name in parsers:
            parsers[name]().parse_args(rest)
        else:
            build_parser().parse_args(arguments)
    except SystemExit as exit:  # --help
        assert exit.code == 0, command


@pytest.mark.parametrize("target", MAKE_TARGETS)
def test_every_make_target_exists(target):
    assert re.search(rf"^{re.escape(target)}:", (REPO / "Makefile").read_text(), re.M), target


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_leads_to_a_file(path):
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXTS[path])
    relative = [t for t in targets if not re.match(r"\w+://", t)]
    missing = [t for t in relative if not (path.parent / t).exists()]
    assert not missing, missing


def test_the_readme_is_short_and_leads_to_every_document():
    readme = TEXTS[REPO / "README.md"]
    assert len(readme.splitlines()) <= 250
    for path in DOCUMENTS[1:]:
        assert f"(docs/{path.name})" in readme, f"the README does not lead to docs/{path.name}"
    assert "../shared" not in "".join(TEXTS.values()), "a user has no ../shared"
