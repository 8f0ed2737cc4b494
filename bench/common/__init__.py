"""What the benchmark scripts share: the machine, workloads, models, engine timing, reports,
and bench/gpu_kernels.py's per-section code.

The scripts run as ``python bench/<name>.py``, which puts bench/ on sys.path, so they
import these modules as ``common.<module>``.
"""
