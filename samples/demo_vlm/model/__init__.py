"""The demo VLM's checkpoint, the wheel's package data ``mm_serve.demo_model`` (this file makes
the folder a package that ``importlib.resources`` finds in an editable install too)."""
