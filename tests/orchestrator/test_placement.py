"""Placement bookkeeping without gRPC: least loaded first, sessions stay where they are
placed while that replica is ready, a record's placement is honoured, and a replica that
failed a call is avoided for a while."""

from __future__ import annotations

from hydra_jury.orchestrator.placement import SUSPECT_S, Placements


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_new_sessions_go_to_the_least_loaded_replica_and_stay():
    placements = Placements()
    ready = ["b:1", "a:1"]
    # Ties go to the lowest address; then each new session evens the load.
    assert [placements.address("trunk", s, ready) for s in ("s1", "s2", "s3")] == [
        "a:1",
        "b:1",
        "a:1",
    ]
    assert placements.address("trunk", "s2", ready) == "b:1"  # placed: it stays
    # Load is counted per component: the shard's replicas are placed on their own.
    assert placements.address("jury0", "s1", ["c:1", "d:1"]) == "c:1"
    assert placements.placed("s1") == {"trunk": "a:1", "jury0": "c:1"}


def test_a_session_moves_when_its_replica_is_not_ready():
    placements = Placements()
    assert placements.address("trunk", "s", ["a:1"]) == "a:1"
    assert placements.address("trunk", "s", ["b:1"]) == "b:1"
    assert placements.address("trunk", "s", ["a:1", "b:1"]) == "b:1"


def test_a_records_placement_is_honoured_while_ready():
    placements = Placements()
    placements.address("trunk", "busy", ["a:1", "b:1"])  # a:1 has one session
    assert placements.address("trunk", "back", ["a:1", "b:1"], wanted="a:1") == "a:1"
    assert placements.address("trunk", "gone", ["a:1", "b:1"], wanted="c:1") == "b:1"


def test_a_suspect_is_avoided_for_a_while_and_its_session_leaves_it():
    clock = Clock()
    placements = Placements(clock)
    ready = ["a:1", "b:1"]
    assert placements.address("trunk", "s", ready) == "a:1"
    placements.suspect("a:1", "trunk", "s")
    assert placements.placed("s") == {}
    assert placements.address("trunk", "s", ready) == "b:1"
    assert placements.address("trunk", "new", ready) == "b:1"  # though b:1 is loaded
    assert placements.address("trunk", "only", ["a:1"]) == "a:1"  # all suspect: any
    clock.now += SUSPECT_S + 0.001  # past the window: a:1 is the least loaded again
    assert placements.address("trunk", "later", ready) == "a:1"


def test_a_suspect_keeps_other_sessions_placed_there():
    placements = Placements()
    placements.address("trunk", "s", ["a:1"])
    placements.address("trunk", "other", ["a:1"])
    placements.suspect("a:1", "trunk", "s")
    assert placements.placed("other") == {"trunk": "a:1"}


def test_forget_drops_a_placement_and_returns_it():
    placements = Placements()
    placements.address("trunk", "s", ["a:1"])
    assert placements.forget("s") == {"trunk": "a:1"}
    assert placements.forget("s") == {} and placements.placed("s") == {}
