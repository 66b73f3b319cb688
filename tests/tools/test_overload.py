"""`python -m tools.overload`, short: 4x more closed-loop clients than the split stack
admits, for 5 s. Every request completes or is refused with RESOURCE_EXHAUSTED at once
(the orchestrator refuses past --max-concurrency rather than queueing), no process's
memory grows, and no service holds a session after the load."""

from __future__ import annotations

from tools import overload


def test_overload_is_refused_quickly_without_leaks(jury_checkpoint, capsys):
    code = overload.main(["--seconds", "5", "--warmup", "2", "--checkpoint", str(jury_checkpoint)])
    lines = capsys.readouterr().out.splitlines()
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    _, completed, _, refused, refused_p99, failed = cells
    assert code == 0, "\n".join(lines)
    assert int(completed) > 0 and int(refused) > 0 and failed == "0"
    assert float(refused_p99) < overload.REFUSAL_P99_S
    held = [line.split("|")[-2].strip() for line in lines[7:] if line.startswith("|")]
    assert held and all(h in ("0", "-") for h in held), "\n".join(lines)
