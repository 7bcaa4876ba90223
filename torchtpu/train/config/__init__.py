"""The trainer's configuration: the schema (job_config), reading it (manager) and what it says
about itself (schema). Standard library only: reading a configuration imports no torch or jax."""
