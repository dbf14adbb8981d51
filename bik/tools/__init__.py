"""Tools built on the library: ``python -m bik demo|verify|bench``.

Each tool module has ``add_arguments(parser)``, ``check(args)`` (raises ``cli.UsageError``
for an argument that cannot work, and does no work) and ``main(args) -> exit code``, which
may raise ``UsageError`` too, but only before its first long step. The library layers (ops,
backends, hf, mode) never import from here.
"""
