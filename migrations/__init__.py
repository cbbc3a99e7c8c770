"""Alembic migrations of the job store. Shipped inside the wheel as `bulkgen.migrations`."""
