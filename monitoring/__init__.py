"""What the live sinks and the offline report share: the metric catalog, the trace events, the dashboard generator."""
