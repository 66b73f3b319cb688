"""`make chaos`'s short version (`python -m tools.chaos --short`): real processes on
loopback, an orchestrator killed with SIGKILL while sessions stream through the resuming
client; every completed turn has the tokens of the run without the fault and no round a
client received is missing from its session's record."""

from __future__ import annotations

from tools import chaos


def test_an_orchestrator_killed_mid_stream_loses_no_round(jury_checkpoint, capsys):
    code = chaos.main(["--short", "--checkpoint", str(jury_checkpoint)])
    lines = capsys.readouterr().out.splitlines()
    rows = {
        cells[0]: dict(zip(chaos.COLUMNS, cells, strict=True))
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    }
    killed = rows["orchestrator kill -9"]
    assert code == 0, "\n".join(lines)
    assert int(killed["resumed"]) > 0, "the kill hit no generation in flight"
    assert killed["rounds lost"] == "0" and killed["failed"] == "0"
    same, compared = killed["identical"].split("/")
    assert same == compared == killed["requests"]
