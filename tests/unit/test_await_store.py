"""`dslurm.health.process_group.await_store`: a worker that is not rank 0 waits for rank 0's store
port before torch's client connects (a client started early backs off ~0.6 s, a third of a warm
restart). Real sockets on loopback, no torch."""

from __future__ import annotations

import socket
import threading
import time

from dslurm.health.process_group import await_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_non_zero_rank_returns_once_the_store_listens_not_before():
    port = _free_port()
    listening: list[float] = []
    srv = socket.socket()

    def late() -> None:
        time.sleep(0.3)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        listening.append(time.monotonic())  # before listen(): a connection can only come after it
        srv.listen()
    threading.Thread(target=late, daemon=True).start()
    try:
        assert await_store({"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timeout_s=10)
        done = time.monotonic()
        assert listening and listening[0] <= done  # not before the port was open
        assert done - listening[0] < 0.4  # polled (torch's client backs off ~0.6 s)
    finally:
        srv.close()


def test_rank_zero_an_agents_store_or_no_address_wait_for_nothing():
    port = _free_port()  # nobody listens: any wait would run into the timeout
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    t = time.monotonic()
    assert not await_store({**env, "RANK": "0"}, timeout_s=5)
    assert not await_store({**env, "RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, timeout_s=5)
    assert not await_store({"RANK": "1"}, timeout_s=5)
    assert time.monotonic() - t < 0.5


def test_a_store_that_never_comes_gives_up_after_the_timeout():
    t = time.monotonic()
    assert not await_store({"RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())},
                           timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t < 2.0
