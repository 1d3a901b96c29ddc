"""Shared test helpers (importable as ``helpers``: pytest puts tests/ on sys.path)."""
