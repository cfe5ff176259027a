"""A discrete-event simulator of a cluster of vLLM-like instances.

It calls the same policy core as the proxy (`proxy.policy`) for dispatch and
rescheduling, so what it shows about a policy says something about the proxy.
"""
