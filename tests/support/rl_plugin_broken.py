"""A module that is not a task plug-in (its TASK lacks the Task methods), for the tests."""

TASK = object()
