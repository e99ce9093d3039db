"""Inside the partitioner: the inner compilers, capture of the partitioned graphs, where ops may go,
the rewrite that inserts the ``teraio::`` migration ops, recompute, and the memory a kernel holds.

Nothing here imports :mod:`teraio.lifecycle`: graph surgery knows plans and graphs, not the backend.
"""
