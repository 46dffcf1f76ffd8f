"""Triton flash-attention forward and backward (one backend: ``triton``)."""
