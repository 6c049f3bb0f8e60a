"""Triton kernels of evenkv (``@triton.jit`` code only) and their torch oracles.

Imports only torch and triton; knows nothing of the engines. Launchers live in
``evenkv`` (the ``backend/`` folder).
"""
