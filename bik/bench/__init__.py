"""``python -m bik.bench``: an alias of ``python -m bik bench`` (see bik.tools.bench)."""
