"""The library halves of the commands: the demo, estimates on hardware this machine lacks, workloads and
the built-in models, profiling a workload, and the notebooks' analysis toolbox."""
