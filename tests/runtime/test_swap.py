"""A directory replacement killed (SIGKILL) at each of its steps loses nothing: ``out`` is the old
or the new directory, or is restored by ``recover``; leftovers of dead processes are removed."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from runtime.artifact import swap

MARKER = "manifest.json"
# Runs swap_into_place in a child that SIGKILLs itself at one step (no cleanup can run, as in a
# real kill); "fallback" forces the two-rename path of systems without RENAME_EXCHANGE.
CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from runtime.artifact import swap
    mode, step, out = sys.argv[1:]
    out = Path(out)
    if mode == "fallback":
        swap._exchange = lambda a, b: False
    def hook(name):
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)
    swap._hook = hook
    tmp = swap.temp_sibling(out)  # named after this process, as a build names it
    tmp.mkdir()
    (tmp / "weights.bin").write_bytes(b"new weights")
    if step == "before":  # killed while exporting: no manifest yet
        os.kill(os.getpid(), signal.SIGKILL)
    (tmp / "manifest.json").write_text("new")
    swap.swap_into_place(tmp, out)
""")


def make(directory, text):
    directory.mkdir()
    (directory / MARKER).write_text(text)
    (directory / "weights.bin").write_bytes(os.urandom(1000))



@pytest.mark.parametrize("mode, step, expected", [
    ("exchange", "before", "old"), ("exchange", "exchanged", "new"), ("exchange", "done", "new"),
    ("fallback", "before", "old"), ("fallback", "moved-old", "new"), ("fallback", "moved-new", "new"),
    ("fallback", "done", "new")])
def test_killed_at_each_step_loses_nothing(tmp_path, mode, step, expected):
    out = tmp_path / "model"
    make(out, "old")
    done = subprocess.run([sys.executable, "-c", CHILD, mode, step, str(out)],
                          capture_output=True, text=True)
    killed = step != "done"
    assert done.returncode == (-signal.SIGKILL if killed else 0), done.stderr
    if step in ("before", "exchanged", "done"):  # atomic: out is whole without any recovery
        assert (out / MARKER).read_text() == expected
    swap.recover(out, MARKER)  # what the next build or load does first
    assert (out / MARKER).read_text() == expected
    swap.remove_leftovers(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no .model.tmp-PID / .model.old-PID


def test_exchange_is_used_where_the_filesystem_has_it(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    make(a, "new")
    make(b, "old")
    if not swap._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this filesystem")
    assert (a / MARKER).read_text() == "old" and (b / MARKER).read_text() == "new"


def test_recover_prefers_the_complete_new_over_the_old(tmp_path):
    out = tmp_path / "model"
    make(tmp_path / ".model.old-999999999", "old")
    make(tmp_path / ".model.tmp-999999999", "new")
    assert swap.recover(out, MARKER) == out and (out / MARKER).read_text() == "new"
    (tmp_path / ".model.tmp-999999998").mkdir()  # an unfinished build: no manifest
    out2 = tmp_path / "other"
    assert swap.recover(out2, MARKER) is None and not out2.exists()


def test_leftovers_of_live_processes_stay(tmp_path):
    out = tmp_path / "model"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        make(tmp_path / f".model.tmp-{live.pid}", "theirs")
        make(tmp_path / ".model.old-999999999", "dead")
        assert swap.remove_leftovers(out) == [tmp_path / ".model.old-999999999"]
        assert (tmp_path / f".model.tmp-{live.pid}").is_dir()  # a build still running
    finally:
        live.kill()
        live.wait()
