"""The emulated cluster for real: namespaces, shaping, a 2-host torchrun job, teardown after failures.

Needs root with ``ip`` and ``tc`` (skipped with the reason otherwise). Each test builds its own
cluster under a unique tag, so concurrent runs do not collide.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.emucluster import (
    SWITCH,
    EmulatedCluster,
    HostCommandFailed,
    cleanup_leftovers,
    cpu,
    list_clusters,
    measure_goodput,
    netns,
)
from tools.emucluster.topology import host_ns, switch_ns

REPO = Path(__file__).resolve().parents[2]
JOB = str(Path(__file__).with_name("allreduce_job.py"))

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(not (shutil.which("ip") and shutil.which("tc")), reason="needs iproute2 (ip, tc)"),
]


def root_links() -> set[str]:
    return {link["ifname"] for link in json.loads(subprocess.check_output(["ip", "-j", "link", "show"]))}


def cli(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.emucluster", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_build_and_teardown_leave_nothing_behind_and_never_touch_the_root_namespace():
    """Hosts get lo, eth0, MTU, address, tbf both ways, their own resolvable hostname; all goes away."""
    links_before, hostname_before = root_links(), socket.gethostname()
    with EmulatedCluster(3, "1gbit", mtu=9000) as cluster:
        assert set(cluster.namespaces) <= set(netns.list_namespaces())
        assert root_links() == links_before               # veth ends were born inside the namespaces
        for host in cluster.hosts:
            addrs = {i["ifname"]: i for i in json.loads(netns.ip(host.ns, "-j", "addr", "show"))}
            assert set(addrs) == {"lo", "eth0"}
            assert "UP" in addrs["lo"]["flags"] and "UP" in addrs["eth0"]["flags"]
            assert addrs["eth0"]["mtu"] == 9000
            assert [a["local"] for a in addrs["eth0"]["addr_info"] if a["family"] == "inet"] == [host.addr]
            for ns, dev in ((host.ns, "eth0"), (cluster.switch.ns, f"h{host.index}")):
                (tbf,) = [q for q in netns.qdisc_json(ns, dev) if q["kind"] == "tbf"]
                assert tbf["options"]["rate"] * 8 == 10**9
        names = cluster.run([sys.executable, "-c", "import socket; n = socket.gethostname(); "
                             "print(n, socket.gethostbyname(n), socket.gethostbyname('localhost'))"], timeout_s=30)
        assert [r.stdout.split() for r in names] == [[h.name, h.addr, "127.0.0.1"] for h in cluster.hosts]
        ping = cluster.start(cluster.hosts[0], ["sleep", "30"])   # a process still running at teardown
    assert ping.poll() is not None
    assert not set(cluster.namespaces) & set(netns.list_namespaces())
    assert not set(cluster.namespaces) & set(netns.list_etc())
    assert root_links() == links_before
    assert socket.gethostname() == hostname_before


@pytest.mark.slow
def test_rate_limit_is_measured_within_ten_percent_of_nominal():
    with EmulatedCluster(2, "1gbit") as cluster:
        goodput = measure_goodput(cluster, seconds=2.0)
    # TCP goodput at MTU 1500 is at most 1448/1514 = 95.6% of the wire rate tbf enforces.
    assert 0.90 <= goodput.fraction <= 1.0, goodput


@pytest.mark.slow
def test_the_switch_port_is_unshaped_so_two_hosts_together_exceed_one_link():
    with EmulatedCluster(2, "200mbit") as cluster:
        both = measure_goodput(cluster, senders=(0, 1), dst=SWITCH, seconds=1.5)
    # Each host's own link still limits it (<= 2 links' worth); the switch (an in-network
    # aggregator's seat) takes more than one link could carry. Low rate: little CPU needed.
    assert 1.3 <= both.gbps / 0.2 <= 2.0, both


@pytest.mark.slow
def test_two_host_torchrun_job_all_reduces_over_the_emulated_network():
    with EmulatedCluster(2, "1gbit") as cluster:
        results = cluster.torchrun([JOB], timeout_s=90, env={"OMP_NUM_THREADS": "1"})
    reports = sorted((json.loads(r.stdout.strip().splitlines()[-1]) for r in results), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["sum"] == 3.0 and r["world"] == 2 and r["ifname"] == "eth0" for r in reports)
    assert {r["host"] for r in reports} == {"0", "1"}


def test_a_failing_host_stops_the_others_and_names_itself():
    with EmulatedCluster(2, "1gbit") as cluster:
        t0 = time.monotonic()
        with pytest.raises(HostCommandFailed, match=r"host 1 exited with 3") as err:
            cluster.run(lambda h: ["sh", "-c", "sleep 60" if h.index == 0 else "echo boom >&2; exit 3"],
                        timeout_s=60)
        assert time.monotonic() - t0 < 20
        assert "boom" in str(err.value)
        assert err.value.results[0].stopped
        assert all(not netns.namespace_pids(h.ns) for h in cluster.hosts)


def test_a_run_past_its_timeout_is_killed():
    with EmulatedCluster(2, None) as cluster:
        with pytest.raises(HostCommandFailed, match="ran past its timeout"):
            cluster.run(["sleep", "60"], timeout_s=1.0)
        assert all(not netns.namespace_pids(h.ns) for h in cluster.hosts)


def test_an_exception_inside_the_block_still_tears_everything_down():
    with pytest.raises(RuntimeError, match="user code failed"):
        with EmulatedCluster(2, "1gbit") as cluster:
            proc = cluster.start(cluster.hosts[1], ["sleep", "60"])
            raise RuntimeError("user code failed")
    assert proc.poll() is not None
    assert not set(cluster.namespaces) & set(netns.list_namespaces())


def killed_owner_tag(cluster_args: str) -> str:
    """Build ``EmulatedCluster(cluster_args)`` with a process on host 0 in a child, kill the child; its tag."""
    code = ("import time; from tools.emucluster import EmulatedCluster; "
            f"c = EmulatedCluster({cluster_args}).up(); c.start(c.hosts[0], ['sleep', '60']); "
            "print(c.tag, flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        return owner.stdout.readline().strip()
    finally:
        owner.kill()
        owner.wait()


def test_leftovers_of_a_killed_owner_are_cleaned_up_and_live_clusters_are_kept():
    tag = killed_owner_tag("2, '1gbit'")
    assert tag in list_clusters()
    with EmulatedCluster(1, None) as mine:
        removed = cleanup_leftovers()
        assert set(removed) == {host_ns(tag, 0), host_ns(tag, 1), switch_ns(tag)}
        assert mine.tag in list_clusters()
    assert tag not in list_clusters()


BUSY = ("import time; t = time.time(); c = time.process_time()\n"
        "while time.time() - t < 1.5: pass\n"
        "print((time.process_time() - c) / (time.time() - t), [l.strip() for l in open('/proc/self/cgroup') "
        "if ':cpu:' in l or ':cpuset:' in l or l.startswith('0::')])")


@pytest.mark.slow
def test_cpu_quota_holds_each_host_to_its_cores_and_goes_with_the_cluster():
    """Two hosts of 0.5 cores busy-loop at once: each gets at most half a core, in its own group."""
    ctl = cpu.find_controller()
    with EmulatedCluster(2, None, cpus=0.5) as cluster:
        assert cpu.list_tags(ctl).count(cluster.tag) == 1
        limited = cluster.run([sys.executable, "-c", BUSY], timeout_s=60)
        attached = EmulatedCluster.attach(cluster.tag)
        assert attached.cpus == pytest.approx(0.5)
        attached.detach()
    for r in limited:
        share, groups = r.stdout.rsplit(" [", 1)
        assert float(share) <= 0.6, r.stdout                 # the quota: 5 ms of CPU per 10 ms
        assert f"emucluster-{cluster.tag}/h{r.host}" in groups
    pinned = cpu.pinning(2, 0.5, os.cpu_count() or 1)
    if cpu.find_cpuset() is not None and pinned:                # each host on its own CPU share
        assert all(f"cpuset:/emucluster-{cluster.tag}/h{r.host}" in r.stdout for r in limited)
    assert cluster.tag not in cpu.list_tags(ctl)
    with EmulatedCluster(1, None) as free:                  # no quota: one busy loop gets ~a core
        (unlimited,) = free.run([sys.executable, "-c", BUSY], timeout_s=60)
    assert float(unlimited.stdout.split()[0]) > float(limited[0].stdout.split()[0]) * 1.3


@pytest.mark.slow
def test_a_host_keeps_its_quota_on_a_busy_machine():
    """Busy loops outside the cluster, three per core, each in its own session (as other users' jobs
    are: the kernel's autogroups weigh sessions, not processes), do not take a host's half core (its
    group is weighted first); without the weight the host got a quarter of a core here."""
    cores = os.cpu_count() or 1
    spin = "import time; t = time.time()\nwhile time.time() - t < 4: pass"
    others = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(3 * cores)]
    try:
        with EmulatedCluster(1, None, cpus=0.5) as cluster:
            (busy,) = cluster.run([sys.executable, "-c", BUSY], timeout_s=60)
    finally:
        for p in others:
            p.kill()
            p.wait()
    assert float(busy.stdout.split()[0]) >= 0.4, busy.stdout


def test_leftover_cpu_groups_of_a_killed_owner_are_cleaned_up():
    tag = killed_owner_tag("1, None, cpus=0.5")
    ctl = cpu.find_controller()
    assert tag in cpu.list_tags(ctl)
    removed = cleanup_leftovers()
    assert str(ctl.cluster_dir(tag)) in removed
    assert tag not in cpu.list_tags(ctl) and tag not in list_clusters()


def test_cli_interrupt_tears_down_the_transient_cluster():
    # Ctrl-C as a terminal sends it: the CLI takes SIGINT as KeyboardInterrupt even where the suite itself runs with
    # SIGINT ignored (a shell's background job, `nohup ... &`), which a child would inherit, and then it never stopped.
    ctrl_c = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "runpy.run_module('tools.emucluster', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", ctrl_c, "run", "--hosts", "2", "--", "sleep", "60"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    tags = set()
    while time.monotonic() < deadline and not tags:
        tags = {t for t in list_clusters() if t.startswith(f"{proc.pid}x")}
        time.sleep(0.1)
    assert tags, "the CLI never built its cluster"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert not tags & set(list_clusters())


def test_cli_up_exec_list_down():
    name = f"t{os.getpid()}"
    try:
        up = cli("up", name, "--hosts", "2", "--rate", "100mbit", "--mtu", "1400")
        assert up.returncode == 0, up.stderr
        listed = cli("list")
        assert name in listed.stdout and "100 Mbit/s" in listed.stdout and "1400" in listed.stdout
        ex = cli("exec", name, "1", "--", "sh", "-c", "echo $RANK $EMUCLUSTER_ADDR")
        assert ex.returncode == 0 and ex.stdout.split() == ["1", "10.213.0.2"]
        again = cli("up", name, "--hosts", "2")
        assert again.returncode == 2 and "already exists" in again.stderr
    finally:
        down = cli("down", name)
    assert down.returncode == 0 and name not in list_clusters()


def test_refuses_clearly_without_ip_and_tc_or_without_root():
    no_tools = cli("run", "--hosts", "2", "--", "true", env={**os.environ, "PATH": "/nonexistent"})
    assert no_tools.returncode == 2 and "ip and tc not found" in no_tools.stderr
    if shutil.which("setpriv"):
        nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                 "-m", "tools.emucluster", "list"], cwd=REPO, capture_output=True, text=True,
                                timeout=60)
        assert nobody.returncode == 2 and "needs root" in nobody.stderr


@pytest.mark.slow
def test_four_hosts_torchrun_and_senders_share_the_receivers_link():
    with EmulatedCluster(4, "1gbit") as cluster:
        incast = measure_goodput(cluster, senders=(1, 2, 3), dst=0, seconds=2.0)
        assert 0.85 <= incast.fraction <= 1.0, incast       # three senders share host 0's one link
        results = cluster.torchrun([JOB], timeout_s=120, env={"OMP_NUM_THREADS": "1"})
    assert sorted(json.loads(r.stdout.strip().splitlines()[-1])["rank"] for r in results) == [0, 1, 2, 3]
