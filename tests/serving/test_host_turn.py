"""The host turn (`serving.host_turn`): the trunk holds it alone, the jury shards beside
one another, across processes; a cancelled wait never keeps it; a shard waiting with
calls queued makes the trunk run its batch at once."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from hydra_jury.serving.host_turn import HostTurn
from tests.worker_services import TurnPeer


@pytest.fixture
def turns(tmp_path):
    """turns(shared) → a HostTurn on one lock file (each its own open file, as each
    process has), all closed afterwards."""
    made = []

    def turn(shared: bool = False) -> HostTurn:
        made.append(HostTurn(tmp_path / "host.turn", shared=shared))
        return made[-1]

    yield turn
    for turn in made:
        turn.close()


def test_the_trunk_holds_the_turn_alone_and_the_shards_together(turns):
    trunk, shard0, shard1 = turns(), turns(shared=True), turns(shared=True)
    assert shard0.try_acquire() and shard1.try_acquire()  # shards side by side
    assert trunk.busy() and not trunk.try_acquire()  # but not beside the trunk
    assert not shard0.busy()  # its own holding is not another's batch
    shard0.release()
    assert trunk.busy()
    shard1.release()
    assert not trunk.busy() and trunk.try_acquire()
    assert shard0.busy() and not shard1.try_acquire()
    other = turns()
    assert other.busy() and not other.try_acquire()  # two trunks take turns too
    trunk.release()
    assert not other.busy()


def test_acquire_waits_for_the_holder_and_a_cancelled_wait_lets_go(turns):
    holder, waiter, third = turns(), turns(), turns()

    async def scenario() -> None:
        assert holder.try_acquire()
        waiting = asyncio.create_task(waiter.acquire())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        holder.release()
        await asyncio.wait_for(waiting, 5)
        assert waiter.held and third.busy()
        waiter.release()

        assert holder.try_acquire()
        cancelled = asyncio.create_task(waiter.acquire())
        await asyncio.sleep(0.05)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        holder.release()  # the cancelled wait now gets the turn, and lets it go
        await asyncio.wait_for(third.acquire(), 5)
        assert not waiter.held
        third.release()

    asyncio.run(scenario())


def test_the_turn_is_between_processes_and_a_dead_holder_lets_go(tmp_path, turns):
    path = tmp_path / "host.turn"
    script = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "held\n"
        shard = turns(shared=True)
        assert shard.busy() and not shard.try_acquire()
    finally:
        child.kill()
        child.wait()
    assert not shard.busy() and shard.try_acquire()


def test_a_lock_file_that_cannot_be_opened_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"--host-turn: cannot open the lock file .*missing"):
        HostTurn(tmp_path / "missing" / "host.turn")


def test_holding_keeps_the_turn_for_its_block_and_lets_go_on_an_error(turns):
    turn, other = turns(), turns()

    async def scenario() -> None:
        async with turn.holding():
            assert turn.held and other.busy()
        assert not turn.held and not other.busy()
        with pytest.raises(RuntimeError, match="a batch failed"):
            async with turn.holding():
                raise RuntimeError("a batch failed")
        assert not other.busy()

    asyncio.run(scenario())


def test_a_shard_gathering_makes_the_trunk_yield_until_it_stops_or_dies(tmp_path, turns):
    """Each role in a process of its own, as the services run (a process's record locks
    are its own: one of its turns taking the byte would take another's mark with it)."""
    path = tmp_path / "host.turn"
    trunk = turns()
    shards = [TurnPeer(path, shared=True) for _ in range(2)]
    try:
        assert not trunk.yields()
        shards[0].ask("mark_gathering")
        assert trunk.yields() and trunk.yields()  # a look leaves the mark in place
        shards[1].ask("mark_gathering")  # two shards waiting side by side
        shards[0].ask("unmark_gathering")
        assert trunk.yields()
        shards[1].ask("unmark_gathering")
        assert not trunk.yields()
        shards[0].ask("mark_gathering")
        assert shards[0].ask("yields") == "False"  # a shard is the one waited on
    finally:
        for peer in shards:
            peer.close()  # a dead shard's mark goes with it
    assert not trunk.yields()


def test_only_a_shard_marks_that_it_is_gathering(tmp_path, turns):
    path = tmp_path / "host.turn"
    shard = turns(shared=True)
    trunks = [TurnPeer(path, shared=False) for _ in range(2)]
    try:
        shard.mark_gathering()
        assert trunks[0].ask("yields") == "True"
        shard.unmark_gathering()
        assert trunks[0].ask("yields") == "False"
        trunks[1].ask("mark_gathering")  # the trunk has no one to make yield
        assert trunks[0].ask("yields") == "False"
    finally:
        for peer in trunks:
            peer.close()
