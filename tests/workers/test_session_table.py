"""The session table's slots: a finished generation's slot goes to a newcomer at once,
least recently used first; a running one's only after the reclaim grace; a newcomer is
refused only when every slot holds a running generation."""

from __future__ import annotations

import time

import pytest

from hydra_jury.workers.errors import SESSIONS_RUNNING, CapacityError
from hydra_jury.workers.sessions import EVICTED, FINISHED, IDLE, SessionLimits, SessionTable


def table(max_sessions: int, **limits) -> tuple[SessionTable, list[str], list[str]]:
    """A table of plain states; what it destroyed and why it reclaimed, in order."""
    destroyed, reasons = [], []
    sessions = SessionTable(SessionLimits(max_sessions, 64, **limits), object, destroyed.append)
    sessions.on_reclaim = reasons.append
    return sessions, destroyed, reasons


def test_a_finished_slot_goes_to_a_newcomer_at_once_least_recently_used_first():
    sessions, destroyed, reasons = table(3, reclaim_after_s=60)
    states = {name: sessions.get(name, start=0) for name in ("a", "b", "c")}
    assert sessions.running == 3
    assert sessions.finish("b") and sessions.finish("a") and not sessions.finish("nobody")
    assert sessions.running == 1
    sessions.get("d", start=0)  # "b" finished before "a": it goes first
    sessions.get("e", start=0)
    assert destroyed == [states["b"], states["a"]]
    assert reasons == [FINISHED, FINISHED]
    with pytest.raises(CapacityError, match="in use by running generations") as refused:
        sessions.get("f", start=0)  # c, d and e are running, well within the grace
    assert refused.value.reason == SESSIONS_RUNNING
    assert len(sessions) == 3 and sessions.running == 3


def test_a_finished_slot_goes_before_an_older_idle_running_one():
    sessions, destroyed, reasons = table(2, reclaim_after_s=0.0)
    running = sessions.get("running", start=0)
    finished = sessions.get("finished", start=0)
    sessions.finish("finished")
    sessions.get("new", start=0)
    assert destroyed == [finished] and reasons == [FINISHED]
    sessions.get("newer", start=0)  # nothing finished: the running one idle past 0 s
    assert destroyed == [finished, running] and reasons == [FINISHED, IDLE]


def test_a_running_slot_is_reclaimed_only_past_the_grace():
    sessions, _, reasons = table(1, reclaim_after_s=0.05)
    sessions.get("abandoned", start=0)
    with pytest.raises(CapacityError):
        sessions.get("new", start=0)
    time.sleep(0.06)
    sessions.get("new", start=0)
    assert reasons == [IDLE]


def test_a_next_turn_makes_a_finished_session_running_again():
    sessions, destroyed, _ = table(2, reclaim_after_s=60)
    kept = sessions.get("conversation", start=0)
    sessions.finish("conversation")
    assert sessions.get("conversation", start=5) is kept  # its next turn
    sessions.get("other", start=0)
    with pytest.raises(CapacityError):
        sessions.get("third", start=0)
    assert destroyed == []


def test_a_held_session_is_never_reclaimed():
    sessions, _, _ = table(1, reclaim_after_s=0.0)
    sessions.get("drafting", start=0)
    sessions.hold("drafting")
    sessions.finish("drafting")
    with pytest.raises(CapacityError):
        sessions.get("new", start=0)


def test_idle_eviction_is_reported():
    sessions, _, reasons = table(2, idle_timeout_s=0.01)
    sessions.get("old", start=0)
    time.sleep(0.02)
    assert sessions.evict_idle() == ["old"]
    assert reasons == [EVICTED]


def test_check_room_refuses_what_get_would_and_changes_nothing():
    """A server's event loop refuses a newcomer at once when `get` would (every slot held
    by a running generation), and lets through every call `get` would take."""
    sessions, destroyed, _ = table(2, reclaim_after_s=0.2)
    sessions.get("a", start=0)
    sessions.get("b", start=0)
    with pytest.raises(CapacityError, match="in use by running generations") as refused:
        sessions.check_room("c", 0)
    assert refused.value.reason == SESSIONS_RUNNING
    with pytest.raises(CapacityError):
        sessions.get("c", start=0)  # what `get` does too
    sessions.check_room("a", 0)  # a session the table holds
    sessions.check_room("c", 5)  # not a newcomer's call (`get` says the session is unknown)
    sessions.hold("a")
    sessions.finish("b")
    sessions.check_room("c", 0)  # b's slot goes to a newcomer
    assert len(sessions) == 2 and destroyed == []  # the look changed nothing
    sessions.get("b", start=3)  # b's next turn: running again
    time.sleep(0.25)
    sessions.check_room("c", 0)  # b is idle past the grace; a is held, never reclaimed
    sessions.get("c", start=0)
    assert destroyed and len(sessions) == 2


def test_check_room_counts_idle_evictions():
    sessions, _, _ = table(1, reclaim_after_s=60, idle_timeout_s=0.1)
    sessions.get("a", start=0)
    with pytest.raises(CapacityError):
        sessions.check_room("b", 0)
    time.sleep(0.15)
    sessions.check_room("b", 0)  # a is past the idle timeout: `get` evicts it
    sessions.get("b", start=0)
