"""Exporters: turn the profiler's records into Prometheus metrics, OTel spans, traces and console text."""
