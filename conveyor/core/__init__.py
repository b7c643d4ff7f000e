"""The torch-free engine core: the step (engine_core.py), the loop, stats, the step trace and the wire types."""
