"""A stand-in for the python of a llama-cpp-python venv (tests have no llama.cpp): it answers
tools.bench.venv's probe with a version, and runs ``worker`` (python source) in place of
tools/bench/llamacpp_worker.py, which it is handed first and drops: the worker sees
``sys.argv[1:]`` = the subcommand and its arguments."""

import sys


def stand_in_python(directory, worker: str):
    """The stand-in's path in ``directory``, running ``worker``."""
    script = directory / "worker.py"
    script.write_text(worker)
    python = directory / "python"
    python.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo '{{\"llama-cpp-python\": \"0\"}}'; exit 0; fi\n"
                      f"shift\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    return python
