"""The errors the harness reports as one-line messages (``python -m rl_harness`` prints them
and exits with status 2) instead of tracebacks."""


class HarnessError(Exception):
    """A problem with what the user asked for; the message names the argument and a fix."""


class ConfigError(HarnessError, ValueError):
    """A configuration that cannot run, reported before any work starts."""


class RunDirError(HarnessError):
    """A run directory (``--out``, ``--resume``, ``compare``) that cannot be used as asked."""
