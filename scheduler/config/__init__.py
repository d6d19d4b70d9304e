"""Configuration: settings, schedules, URLs and budgets. A leaf: no database code."""
