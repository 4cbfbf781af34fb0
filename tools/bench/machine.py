"""What the page says about the machine: CPU, cores, memory, library versions, date."""

from __future__ import annotations

import datetime
import os
import platform
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("torch", "onnxruntime", "transformers", "numpy")


def cpu_model(cpuinfo: str | None = None) -> str:
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return platform.processor() or "unknown CPU"
    for line in cpuinfo.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def describe() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib(),
            "python": platform.python_version(), "platform": platform.platform(),
            "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
