"""Monitoring: where a training run's time went (goodput and badput by cause, across restarts),
whether it is healthy (hangs, loss spikes), from the files a run directory holds.

``monitor`` reads what ``train`` writes (``hypertron.runfiles``); ``train`` never imports it.
"""
