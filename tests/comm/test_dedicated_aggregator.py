"""The dedicated aggregator over real TCP: workers are threads here (the protocol needs no
torch.distributed); the server is the one `hybridpipe aggregator` runs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from hybridpipe.comm.allreduce.dedicated import AggregatorClient, AggregatorError, AggregatorServer, parse_address
from hybridpipe.errors import UserError


def _serve(world: int, sessions: int = 1, **kw) -> tuple[AggregatorServer, threading.Thread, str]:
    server = AggregatorServer("127.0.0.1", 0, world, **kw)
    thread = threading.Thread(target=server.serve, args=(sessions,), daemon=True)
    thread.start()
    return server, thread, f"127.0.0.1:{server.address[1]}"


def _workers(world: int, body, timeout: float = 30.0) -> dict[int, object]:
    """Run ``body(position)`` in ``world`` threads; their results or exceptions by position."""
    out: dict[int, object] = {}

    def run(p: int) -> None:
        try:
            out[p] = body(p)
        except Exception as e:           # noqa: BLE001 - compared by the test
            out[p] = e

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return out


def _vector(p: int, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * call + p)
    if dtype.is_floating_point:
        return torch.randint(-50, 50, (numel,), generator=g).to(dtype)     # exact in any order
    return torch.randint(-2**50, 2**50, (numel,), generator=g, dtype=dtype)


@pytest.mark.parametrize("world", [1, 3])
def test_sums_every_dtype_and_size_in_place(world: int) -> None:
    server, thread, address = _serve(world, chunk_bytes=1000, buffers=2)
    cases = [(dtype, numel) for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64)
             for numel in (1, 250, 251, 100_003)]

    def body(p: int) -> bool:
        client = AggregatorClient(address, p, world)
        ok = True
        for call, (dtype, numel) in enumerate(cases):
            x, bias = _vector(p, numel, dtype, call), _vector(p, 3, dtype, call + 1000)
            client.allreduce([x, bias])
            ok &= torch.equal(x, sum(_vector(q, numel, dtype, call) for q in range(world)))
            ok &= torch.equal(bias, sum(_vector(q, 3, dtype, call + 1000) for q in range(world)))
        client.close()
        return ok

    assert _workers(world, body) == {p: True for p in range(world)}
    thread.join(10)
    assert server.sessions_served == 1
    server.close()


def test_disagreeing_workers_get_an_error_not_a_hang() -> None:
    server, thread, address = _serve(2, timeout_s=20)

    def body(p: int) -> object:
        client = AggregatorClient(address, p, 2)
        client.allreduce([torch.ones(10 + p)])

    out = _workers(2, body)
    assert all(isinstance(e, AggregatorError) and "disagree" in str(e) for e in out.values()), out
    server.close()


def test_wrong_group_size_is_refused() -> None:
    server, thread, address = _serve(2)
    with pytest.raises(AggregatorError, match="serves a group of 2, not 3"):
        AggregatorClient(address, 0, 3).allreduce([torch.ones(4)])
    server.close()


def test_a_worker_leaving_midway_fails_the_others() -> None:
    server, thread, address = _serve(2, timeout_s=20, chunk_bytes=4096)

    def body(p: int) -> object:
        client = AggregatorClient(address, p, 2)
        client.allreduce([torch.ones(8)])
        if p == 1:
            client.close()                  # leaves; worker 0 goes on alone
            return "left"
        t0 = time.monotonic()
        try:
            client.allreduce([torch.ones(1 << 20)])
        except AggregatorError as e:
            return ("failed", time.monotonic() - t0, str(e))
        return "no error"

    out = _workers(2, body)
    assert out[1] == "left"
    assert out[0][0] == "failed" and out[0][1] < 15, out
    server.close()


def test_unreachable_aggregator_names_the_command_to_start_it() -> None:
    """Nobody listens: the worker dials for a bounded time, then one line (a UserError, so launch
    exits 2 without a traceback) naming the address and the command that starts one."""
    server, thread, address = _serve(1)
    server.close()
    thread.join(5)
    t0 = time.monotonic()
    with pytest.raises(AggregatorError, match="hybridpipe aggregator --port") as e:
        AggregatorClient(address, 0, 1, connect_s=0.5).allreduce([torch.ones(2)])
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert "Connection refused" in str(e.value) and " tries in " in str(e.value)
    assert 0.2 < time.monotonic() - t0 < 5
    with pytest.raises(UserError, match="cannot reach the aggregator at no-such-host.invalid:1 .*1 try in"):
        AggregatorClient("no-such-host.invalid:1", 0, 1).allreduce([torch.ones(2)])


def test_an_aggregator_that_starts_after_the_worker_is_reached() -> None:
    server, thread, address = _serve(1)
    port = server.address[1]
    server.close()
    thread.join(5)
    late: list[AggregatorServer] = []

    def start_late() -> None:
        time.sleep(0.4)
        late.append(AggregatorServer("127.0.0.1", port, 1))
        late[0].serve(1)

    starter = threading.Thread(target=start_late, daemon=True)
    starter.start()
    x = torch.ones(3)
    client = AggregatorClient(address, 0, 1, connect_s=10)
    client.allreduce([x])
    client.close()
    assert x.tolist() == [1.0, 1.0, 1.0]
    starter.join(5)
    late[0].close()


def test_parse_address() -> None:
    assert parse_address("10.0.0.254:29600") == ("10.0.0.254", 29600)
    for bad in ("host", ":1", "host:", "host:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)


def test_the_aggregator_command_serves_real_workers() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hybridpipe.cli", "aggregator", "--port", "0", "--world", "2",
                             "--host", "127.0.0.1", "--sessions", "1"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("aggregator listening on 127.0.0.1:"), line
        address = line.split()[3]

        def body(p: int) -> list[float]:
            client = AggregatorClient(address, p, 2)
            x = torch.tensor([1.0, 2.0]) * (p + 1)
            client.allreduce([x])
            client.close()
            return x.tolist()

        assert _workers(2, body) == {0: [3.0, 6.0], 1: [3.0, 6.0]}
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_aggregator_command_rejects_bad_arguments(capsys) -> None:
    from hybridpipe.cli import main
    assert main(["aggregator", "--port", "0", "--world", "0"]) == 2
    assert "--world: must be >= 1, got 0" in capsys.readouterr().err
