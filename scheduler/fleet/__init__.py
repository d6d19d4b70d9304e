"""What a fleet does together beside claiming: pauses, run-now, catch-up, reload, housekeeping."""
