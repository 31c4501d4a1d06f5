"""Worker modules for the integration tests, importable by the ranks of a local world."""
