"""areal-plugin-local: the embedded CPU inference engine (backend ``local``).

For now the plugin declares the backend's placement; the engine itself lands
with issue 4.
"""
