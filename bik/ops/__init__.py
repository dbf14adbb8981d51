"""Public ops: validate inputs, then dispatch to the selected backend (see bik.backends)."""
