"""Inductor integration: lowerings for the custom ops (registered lazily, see register.py)."""
