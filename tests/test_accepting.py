"""accepting.py: which HTTP worker takes a new connection. Share's rule on a table of counts, and two
acceptors on one listening socket sharing a burst of connections (the workers' processes, in
test_serve_workers.py)."""

import asyncio
import socket

from glmvit_cupy.serving import accepting
from glmvit_cupy.serving.accepting import FULL, HOLD, IDLE, Share


def test_a_worker_leaves_a_connection_to_one_holding_fewer_and_never_waits_for_one_not_accepting():
    counts = [IDLE, IDLE, IDLE]
    a, b = Share(counts, 0, cap=10), Share(counts, 1, cap=10)
    a.held(3)
    assert counts[0] == IDLE  # not accepting yet: none waits for it
    a.accepting = b.accepting = True
    a.held(2)
    b.held(1)
    assert a.hold() == HOLD and b.hold() == 0.0  # the third, IDLE, counts as holding more than anyone
    b.held(2)
    assert a.hold() == b.hold() == 0.0  # even: both take it at once, whichever is first


def test_a_worker_at_its_cap_waits_longer_unless_every_worker_is_full():
    counts = [4, 3]
    a = Share(counts, 0, cap=4)
    a.accepting = True
    assert a.hold() == FULL  # it would refuse what the other can serve
    counts[1] = 4
    assert a.hold() == 0.0  # all full: taken and refused (503) at once, not left waiting
    counts[1] = IDLE
    assert a.hold() == 0.0  # the other does not accept: nobody else would take it


def test_two_acceptors_share_a_burst_of_connections_to_even_their_counts():
    """Worker 0 already holds four connections: of eight new ones, worker 1 takes the first four, then
    they alternate (each acceptor alone would alternate from the start: 4 and 4)."""
    class Held(asyncio.Protocol):
        def __init__(self, mine):
            self.mine = mine

        def connection_made(self, transport):
            self.mine.add(transport)

    async def run():
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        counts, held, tasks = [IDLE, IDLE], [set(), set()], []
        mine = [listener, listener.dup()]  # each its own descriptor of the one socket, as in each worker
        for slot in (0, 1):
            share = Share(counts, slot, cap=100)
            tasks.append(asyncio.ensure_future(accepting.serve(
                mine[slot], 64, lambda s=slot: Held(held[s]), share, lambda s=slot: len(held[s]) + 4 * (s == 0),
                print)))
        await asyncio.sleep(0.05)
        assert counts == [4, 0]
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        for _ in range(200):
            if sum(map(len, held)) == 8:
                break
            await asyncio.sleep(0.01)
        seen = [len(h) for h in held]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:
            c.close()
        for h in held:
            for transport in h:
                transport.close()
        for sock in mine:
            sock.close()
        return seen, counts

    seen, counts = asyncio.run(run())
    assert seen == [2, 6]
    assert counts == [IDLE, IDLE]  # cancelled: no longer accepting
