"""The job registry: `@job`, discovery, and the catalog of jobs with their schedules."""
