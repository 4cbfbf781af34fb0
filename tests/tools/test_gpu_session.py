"""tools/gpu_session.sh, the one script a GPU loan runs (issue 54): its parts at tiny sizes on the CPU
(SMOKE=1), each ending 0, and the three tables it prints for docs/benchmarks-gpu.md."""

import os
import re
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_part_runs_and_the_tables_come_back(tmp_path):
    done = subprocess.run(["bash", "tools/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SMOKE": "1", "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    parts = ("tests", "int4", "agree", "demo", "lossless", "copy")
    ends = re.findall(rf"^== ({'|'.join(parts)}) \(timeout \d+s\).*\n   exit (\d+)", done.stdout, re.M)
    assert ends == [(name, "0") for name in parts], done.stdout[-4000:]
    agree = (tmp_path / "agree.log").read_text()  # the torch backend's int4 against ONNX Runtime's, each kernel
    assert "| cpu | 1.000 |" in agree and "| tinygemm | 1.000 |" in agree, agree
    assert re.search(r"^== step-tiny-random \(timeout \d+s\).*\n   exit 0", done.stdout, re.M)
    for table in ("step-tiny-random", "int4", "lossless", "copy"):
        assert (tmp_path / f"{table}.md").is_file() and f"== {table}.md" in done.stdout
    int4 = (tmp_path / "int4.md").read_text()
    assert "| tiny-random int4 | 1 | full |" in int4 and "| tiny-random int8 | 1 | 2x |" in int4
    assert "| tiny-random int4-tinygemm | 1 | 2x |" in int4
    step = (tmp_path / "step-tiny-random.md").read_text()  # each layer compiled, beside the plain graph steps
    assert re.search(r"^\| tiny-random \| 1 \| 5x \|.*\| \d+\.\d+ \| \d+\.\d+x \| - \| - \|$", step, re.M), step
    # and at full depth, the same graph steps with every row's logits to the host
    assert re.search(r"^\| tiny-random \| 1 \| full \|.*\| \d+\.\d+ \| \d+\.\d+x \|$", step, re.M), step
    assert "lossless: exit 0 after" in (tmp_path / "parts.txt").read_text()
    assert "| 1 | lossless 5x |" in (tmp_path / "lossless.md").read_text()
    assert "| 1 | 64 | 0.00 |" in (tmp_path / "copy.md").read_text()  # a step's logits, pageable and pinned, the ids
    # what comes back from the device machine (at most 8 files): one archive of the logs and tables, no artifact
    with tarfile.open(tmp_path / "gpu-session.tgz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert {"when.txt", "parts.txt", "agree.log", "int4.md", "lossless.md"} <= names and "manifest.json" not in names
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_parts_runs_only_the_parts_it_names(tmp_path):
    done = subprocess.run(["bash", "tools/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "PARTS": "int4 step"})
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^== ([\w-]+) \(timeout", done.stdout, re.M) == ["int4", "step-tiny-random"]
