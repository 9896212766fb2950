"""The OpenAI-compatible HTTP server (FastAPI; the `server` extra)."""
