"""Parallelism applied to the single-device model: TP/SP, FSDP2, pipeline stages and schedules;
and the launch every multi-process command shares (`process_group`)."""
