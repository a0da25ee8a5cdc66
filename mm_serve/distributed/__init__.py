"""Processes and ranks: the tensor-parallel state (``parallel_state``), multiprocessing
contexts that never re-run ``__main__`` (``mp_context``), Ray placement (``ray_actors``)."""
