"""The run-log schema: the record kinds and their one parse (records), typed read views of each kind (views), the
quantity accessors over windows (windows), the span kinds a run names in its table (span_kinds), the GPU classes of
a span (gpu_classes) and the trace-event writer every trace goes through (trace_events).

Standard library only, and nothing of ours outside this room: the trainer, the live sinks, the report and the
clients all read records through it, so none of them needs torch to read a log.
"""
