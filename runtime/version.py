"""The toolkit's version: pyproject reads it (``[tool.setuptools.dynamic]``) and every CLI prints
it with ``--version``, so the two cannot disagree."""

__version__ = "0.1.0"
