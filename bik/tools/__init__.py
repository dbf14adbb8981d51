"""Tools built on the library: ``python -m bik demo|verify|bench``.

Each tool module has ``add_arguments(parser)`` and ``main(args) -> exit code``; the library
layers (ops, backends, hf, mode) never import from here.
"""
