"""Tracking: the MLflow store, the server, the outage spool and the dashboard's view."""
