"""areal datasets and their verifiers: local files, and synthetic arithmetic / countdown tasks."""
