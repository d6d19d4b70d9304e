"""The ledger: its tables (`tables`), and the queries of each feature in a module of its own.

Both backends (PostgreSQL and the embedded SQLite file) use these tables and these queries,
in SQLAlchemy 2 Core; the modules here import nothing of the scheduler above them.
"""
