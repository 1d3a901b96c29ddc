"""Thin adapters that put capskip_fx's run summary where trainers log (``hf``, ``lightning``).

Each imports its framework only when used; nothing in the library imports this package.
"""
