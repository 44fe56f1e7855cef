"""Benchmarks that print numbers: `python -m dpjax.bench` times one training
step (`bench.step`, one JSON line); `python -m dpjax.bench --suite=gpu` runs
a fixed comparison set and prints one table with its targets (`bench.suite`).
"""
