"""The pipeline benchmark's parts, one job per module; benchmarks/pipeline_bench.py composes them.

Modules import each other as `pipeline.<module>`: the scripts run from benchmarks/ (its folder is
the script's own, first on sys.path), never through sys.path edits.
"""
