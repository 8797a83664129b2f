"""The planning session: profile -> plan -> engine, torch-side and free of Lightning (docs/architecture.md)."""
