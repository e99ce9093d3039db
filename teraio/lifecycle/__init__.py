"""What ``torch.compile`` calls: the backend object, the per-graph runner, shape dispatch, step tracking,
the step's planning, measurement outside the graphs, hardware pricing, engines and the run record.

Importing this package loads nothing: ``teraio.config`` reads :mod:`teraio.lifecycle.run_dir` without
paying for torch.
"""
