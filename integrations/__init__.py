"""Engine adapters for mla-backend, installed as ``mla_backend_integrations``."""
