"""Triton kernels of evenkv (``@triton.jit`` code), their thin launchers (``*_launch.py``)
and their plain-torch oracles (``reference.py``).

Imports only torch and triton; knows nothing of the engines. Validation and planning
live one level up, in ``evenkv``.
"""
