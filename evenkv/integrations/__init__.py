"""Engine adapters: thin translations of each engine's batch metadata into evenkv's plan/run.

Each module imports its engine lazily; ``evenkv`` itself never imports an engine.
"""
