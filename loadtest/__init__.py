"""Workloads, benchmark drivers, stand-in servers and the demo for Ferry."""
