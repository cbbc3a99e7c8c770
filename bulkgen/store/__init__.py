"""The job store: the single source of truth for jobs, requests and results. Every SQL query lives
here: `db` (the engine, sessions, open_store), `models` (tables), `queue` (claims, leases, commits), `jobs`
(a new job and its request rows, describe, cancel, retry), `migrate`; `packings` (the claim orders) needs
no SQLAlchemy. Nothing is imported here, so that importing one of them imports only what it needs."""
