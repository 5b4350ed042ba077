"""The emulated cluster's plain-data parts: rates, shaping parameters, names, addresses, torchrun argv.

These need no root and no processes.
"""

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.emucluster.errors import EmuClusterError
from tools.emucluster.topology import (
    AddressPlan,
    format_rate,
    host_ns,
    is_leftover,
    new_tag,
    owner_pid,
    parse_ns,
    parse_rate,
    switch_ns,
    tbf_params,
)
from tools.emucluster.torchrun import torchrun_argv


@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("10G", 10**10), ("100mbit", 10**8), ("2.5gbit", 25 * 10**8),
                                       ("500kbit", 5 * 10**5), (1, 10**9), (0.1, 10**8), ("none", None),
                                       ("unlimited", None), (None, None), (0, None), ("0", None)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["fast", "1 gbyte", "-1gbit", "10bit", -1])
def test_parse_rate_rejects_nonsense(bad):
    with pytest.raises(EmuClusterError):
        parse_rate(bad)


@given(st.one_of(st.tuples(st.integers(100, 999), st.just("kbit")),
                 st.tuples(st.integers(1, 999), st.sampled_from(["mbit", "gbit"]))))
def test_format_then_parse_round_trips(rate):
    n, unit = rate
    bits = parse_rate(f"{n}{unit}")
    assert parse_rate(format_rate(bits).replace(" ", "").replace("/s", "")) == bits


@pytest.mark.parametrize("rate,mtu", [(10**8, 1500), (10**9, 1500), (10**9, 9000), (10**10, 1500), (10**10, 9000)])
def test_tbf_bucket_holds_a_gso_packet_and_queue_holds_several_buckets(rate, mtu):
    p = tbf_params(rate, mtu)
    assert p.burst_bytes >= 65536 + mtu                # one 64 KiB GSO packet passes unsplit
    assert p.burst_bytes >= rate / 8 * 1e-3            # a millisecond at line rate
    assert p.limit_bytes >= 4 * p.burst_bytes
    assert p.tc_args()[:3] == ["tbf", "rate", f"{rate}bit"]


def test_address_plan():
    plan = AddressPlan.parse("10.213.0.0/24", 8)
    assert [plan.host(i) for i in (0, 7)] == ["10.213.0.1", "10.213.0.8"]
    assert plan.switch == "10.213.0.254"
    for bad, hosts in (("10.213.0.0/16", 2), ("8.8.8.0/24", 2), ("10.213.0.1/24", 2), ("nonsense", 2),
                       ("10.213.0.0/24", 254), ("10.213.0.0/24", 0)):
        with pytest.raises(EmuClusterError):
            AddressPlan.parse(bad, hosts)


def test_names_round_trip_and_transient_tags_carry_the_owner():
    tag = new_tag()
    assert owner_pid(tag) == os.getpid() and not is_leftover(tag)
    assert parse_ns(switch_ns(tag)) == (tag, None)
    assert parse_ns(host_ns(tag, 12)) == (tag, 12)
    assert parse_ns("emc-") is None and parse_ns("other-ns") is None
    assert new_tag("lab4") == "lab4" and owner_pid("lab4") is None and not is_leftover("lab4")
    for bad in ("Lab", "a-b", "123x00ff", "", "x" * 30):
        with pytest.raises(EmuClusterError):
            new_tag(bad)


def test_a_dead_owner_makes_a_leftover():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)
    assert is_leftover(f"{dead}x00ab")


def test_torchrun_argv_names_the_store_host_and_each_local_address():
    argvs = [torchrun_argv(["job.py", "--x", "1"], host_index=i, nnodes=3, local_addr=f"10.0.0.{i + 1}",
                           endpoint="10.0.0.1:29400", rdzv_id="t", python="py") for i in range(3)]
    for i, argv in enumerate(argvs):
        assert argv[:3] == ["py", "-m", "torch.distributed.run"]
        assert argv[-3:] == ["job.py", "--x", "1"]
        opts = dict(zip(argv[3:-3:2], argv[4:-3:2], strict=True))
        assert opts["--local-addr"] == f"10.0.0.{i + 1}"
        assert opts["--rdzv-endpoint"] == "10.0.0.1:29400" and opts["--rdzv-backend"] == "c10d"
        assert opts["--nnodes"] == "3"
        assert f"is_host={int(i == 0)}" in opts["--rdzv-conf"]
