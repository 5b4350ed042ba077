"""Per-host CPU quotas (tools/emucluster/cpu.py) without root: the quota arithmetic, finding the
controller, the files a group gets (on a plain folder laid out like a cgroup mount), and how a
host's command joins its group. The kernel's side is tested as root in test_emucluster_root.py."""

from pathlib import Path

import pytest

from tools.emucluster import cpu
from tools.emucluster.errors import EmuClusterError
from tools.emucluster.procs import in_namespace


@pytest.mark.parametrize("cores, period, quota", [(0.5, 10_000, 5_000), (0.25, 10_000, 2_500),
                                                  (2, 100_000, 200_000), (0.1, 10_000, 1_000)])
def test_quota_is_cores_times_period(cores, period, quota):
    assert cpu.quota_us(cores, period) == quota


def test_quota_refuses_what_the_kernel_would_and_says_what_to_do():
    with pytest.raises(EmuClusterError, match="positive"):
        cpu.quota_us(0)
    with pytest.raises(EmuClusterError, match="out of range"):
        cpu.quota_us(0.5, 500)
    with pytest.raises(EmuClusterError, match=r"--cpu-period-us 20000"):
        cpu.quota_us(0.05, 10_000)                    # 500 us < 1 ms: a 20 ms period gives 1 ms


def test_finds_v1_then_v2_and_refuses_without_a_cpu_controller(tmp_path):
    with pytest.raises(EmuClusterError, match="cgroup cpu controller"):
        cpu.find_controller(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("memory pids cpu io\n")
    assert cpu.find_controller(tmp_path) == cpu.Controller(2, tmp_path)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu.find_controller(tmp_path) == cpu.Controller(1, tmp_path / "cpu")


@pytest.mark.parametrize("hosts, cpus, ncpu, where", [
    (4, 0.5, 2, [0, 0, 1, 1]), (8, 0.25, 2, [0, 0, 0, 0, 1, 1, 1, 1]), (2, 1.0, 2, [0, 1]), (2, 0.5, 4, [0, 2]),
    (3, 0.66, 2, None),          # two hosts of 0.66 would share one CPU
    (2, 1.5, 4, None),           # a host needs more than one CPU
])
def test_hosts_are_pinned_evenly_only_where_each_cpu_holds_its_quotas(hosts, cpus, ncpu, where):
    assert cpu.pinning(hosts, cpus, ncpu) == where


@pytest.mark.parametrize("version", [1, 2])
def test_groups_get_the_quota_and_read_it_back(tmp_path, version):
    ctl = cpu.Controller(version, tmp_path)
    cpu.create_groups(ctl, "t1", 3, 0.5, 10_000)
    assert cpu.list_tags(ctl) == ["t1"]
    for i in range(3):
        group = ctl.host_group("t1", i)
        if version == 1:
            assert (group / "cpu.cfs_quota_us").read_text() == "5000"
            assert (group / "cpu.cfs_period_us").read_text() == "10000"
        else:
            assert (group / "cpu.max").read_text() == "5000 10000"
        assert cpu.host_cpus(ctl, "t1", i) == pytest.approx(0.5)
    if version == 2:
        assert (ctl.cluster_dir("t1") / "cgroup.subtree_control").read_text() == "+cpu"
        assert (ctl.cluster_dir("t1") / "cpu.weight").read_text() == "10000"     # hosts first on a busy machine
    else:
        assert (ctl.cluster_dir("t1") / "cpu.shares").read_text() == "262144"
    assert cpu.host_cpus(ctl, "other", 0) is None


def test_an_unwritable_controller_is_refused_with_the_way_out(tmp_path):
    ctl = cpu.Controller(1, tmp_path)
    ctl.cluster_dir("t").mkdir()
    (ctl.cluster_dir("t") / "h0").mkdir()
    (ctl.cluster_dir("t") / "h0" / "cpu.cfs_period_us").mkdir()      # a folder where a file must go
    with pytest.raises(EmuClusterError, match="without --cpus"):
        cpu._write(ctl.cluster_dir("t") / "h0" / "cpu.cfs_period_us", "10000")


def test_a_host_command_joins_its_cgroups_before_entering_the_namespace():
    """`ip netns exec` mounts a fresh /sys, so the cgroups must be joined outside it."""
    argv = in_namespace("ns1", ["python", "-c", "pass"], "host1",
                        [Path("/sys/fs/cgroup/cpu/g/h1"), Path("/sys/fs/cgroup/cpuset/g/h1")])
    assert argv[:2] == ["sh", "-c"] and "cgroup.procs" in argv[2]
    assert argv[3] == "/sys/fs/cgroup/cpu/g/h1 /sys/fs/cgroup/cpuset/g/h1"
    assert argv[4:8] == ["ip", "netns", "exec", "ns1"]
    assert argv[-3:] == ["python", "-c", "pass"]
    assert in_namespace("ns1", ["true"]) == ["ip", "netns", "exec", "ns1", "true"]
