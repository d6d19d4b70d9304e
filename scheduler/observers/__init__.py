"""What observes the gate's outcomes and never steers it.

Events, the run log, alerts, notices, metrics and pings.
"""
