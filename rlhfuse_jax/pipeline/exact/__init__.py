"""Offline exact tools for fused schedules (docs/schedules.md): the time-indexed LP relaxation
with its certificates (time_indexed.py) and the growth of a kept schedule to more micro-batches
(grow.py). They prove bounds unreachable or build schedules the search does not find; the
engine (pipeline/ proper) never imports them (docs/architecture.md §7)."""
