"""runtime.platform.cpu_idle: what other processes do on this process's cores, which spin="auto" (the command
lines' default) reads once at load to choose spinning or sleeping ONNX Runtime workers."""

import json
import os
import subprocess
import sys

import pytest

from runtime.platform import cpu_idle
from runtime.platform.cpu_idle import cores_free, others_busy_cores  # the real ones: conftest patches the module's

linux = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not os.path.exists("/proc/stat"),
                           reason="/proc/stat and sched_getaffinity are Linux's")


def _stat(cpus, busy: dict, steal: dict) -> str:
    """A /proc/stat whose watched CPUs have ``busy`` user jiffies and ``steal`` steal jiffies."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for c in cpus:  # user nice system idle iowait irq softirq steal guest guest_nice
        lines.append(f"cpu{c} {busy.get(c, 0)} 0 0 500 7 0 0 {steal.get(c, 0)} 0 0")
    return "\n".join([*lines, "intr 12345", "ctxt 999"]) + "\n"


@linux
def test_others_busy_cores_counts_the_watched_cpus_steal_included_less_its_own_time(tmp_path, monkeypatch):
    mine = sorted(os.sched_getaffinity(0))
    other = max(mine) + 1  # a CPU this process may not run on: not counted
    stat = tmp_path / "stat"
    stat.write_text(_stat([*mine, other], {}, {}))

    class Clock:  # 0.1 s pass; this process uses 0.05 s of CPU meanwhile
        now, own = 10.0, 3.0

        @classmethod
        def monotonic(cls): return cls.now

        @classmethod
        def process_time(cls): return cls.own

        @classmethod
        def sleep(cls, seconds):
            cls.now += seconds
            cls.own += 0.05
            # 10 user jiffies on one watched CPU, 5 stolen on another (or the same), 100 on the other CPU
            stat.write_text(_stat([*mine, other], {mine[0]: 10, other: 100}, {mine[-1]: 5}))

    monkeypatch.setattr(cpu_idle, "time", Clock)
    tick = os.sysconf("SC_CLK_TCK")
    assert others_busy_cores(0.1, str(stat)) == pytest.approx((15 / tick - 0.05) / 0.1)


def test_an_unreadable_stat_is_not_free(tmp_path):
    assert others_busy_cores(0.01, str(tmp_path / "none")) is None
    assert cores_free(0.01, str(tmp_path / "none")) is False
    (tmp_path / "empty").write_text("intr 1\n")
    assert others_busy_cores(0.01, str(tmp_path / "empty")) is None


@linux
def test_a_busy_process_beside_takes_the_cores():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert others_busy_cores(0.3) > 0.5
        assert cores_free(0.3) is False
    finally:
        busy.kill()
        busy.wait()


_AUTO = """
import json, sys
import runtime, runtime.platform.cpu_idle
runtime.platform.cpu_idle.cores_free = lambda *a, **k: sys.argv[2] == "free"
with runtime.load(sys.argv[1], check_hashes=False, max_batch=1, threads=1, spin="auto") as g:
    pools = sorted({s.get_session_options().use_per_session_threads for s in g.backend._sessions.values()})
    print(json.dumps([g.backend.spin, pools, g.generate("Hello, my name is", 6, ignore_eos=True).token_ids]))
"""


def test_auto_spins_on_the_shared_pool_where_the_cores_are_free_and_sleeps_where_not(artifact_dir):
    """Each case in a process of its own: the shared pool is the process's."""
    out = {}
    for case in ("free", "taken"):
        done = subprocess.run([sys.executable, "-c", _AUTO, str(artifact_dir), case], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        out[case] = json.loads(done.stdout.splitlines()[-1])
    assert out["free"][:2] == [True, [False]]  # spinning, every graph on the process's pool
    assert out["taken"][:2] == [False, [True]]  # sleeping, a pool per graph
    assert out["free"][2] == out["taken"][2]


def test_the_command_line_says_what_its_workers_do(artifact_dir, capsys):
    from runtime.__main__ import main

    for flag, line in ((), "workers: sleeping (other processes used the cores at start, or /proc/stat could "
                           "not tell; --spin to spin anyway)"), \
                      (("--no-spin",), "workers: sleeping (--no-spin)"):
        assert main([str(artifact_dir), "Hello", "--max-new-tokens", "2", "--no-check-hashes", *flag]) == 0
        assert line in capsys.readouterr().err.splitlines()
