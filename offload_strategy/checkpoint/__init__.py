"""Checkpoints: a sharded checkpoint directory converted to the single file plain Lightning writes,
and back (``consolidate.py``)."""
