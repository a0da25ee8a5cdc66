"""Tensor-parallel building blocks of the language models (world size 1 by default)."""
