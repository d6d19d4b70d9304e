"""The command line: commands, their tables and the checks `scheduler check` runs."""
